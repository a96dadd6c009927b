"""Structured output on the engine: masks, every kind of language, refusals, and greedy tokens
equal to transformers' ``generate`` with the same language enforced by a logits processor of
its own (the grammar engine is shared; the masking, unpacking and the engine's use are not)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest
import torch

from services.language.engine import sampling
from services.language.engine.grammar import Guide
from services.language.engine.request import ErrorKind, FinishReason, RequestError
from services.language.engine.sampling import (
    NoAllowedTokenError,
    SamplerState,
    SamplingParams,
    StructuredOutput,
    sample,
)
from tests.conftest import ARCHS
from tests.language.conftest import run_to_completion, tokens_of

SCHEMA = {
    "type": "object",
    "properties": {
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "colour": {"enum": ["red", "green"]},
        "ok": {"type": "boolean"},
    },
    "required": ["count", "colour", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{3}-[0-9]{2}"
CHOICES = ["red", 'a "quoted" one', "two\nlines", "ünïcödé"]
LARK = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'
GBNF = 'root ::= "up" | "down"'


@pytest.fixture(scope="module")
def h(harness):
    return harness(ARCHS[0])


@pytest.fixture(scope="module")
def engine(h):
    return h.engine()


def _run(engine, structured, prompt="say something", max_new_tokens=48, **kw):
    inputs = engine.tokenize_messages([{"role": "user", "content": prompt}])
    rid = f"so-{len(engine.requests)}-{engine.num_batches}-{prompt}"
    params = SamplingParams(max_new_tokens=max_new_tokens, structured=structured, **kw)
    engine.add_request(rid, params, inputs)
    outs = run_to_completion(engine)[rid]
    return "".join(o.text for o in outs), outs


class _Known:
    """A matcher whose mask is known (the Guide's own bookkeeping on top of it is tested)."""

    def __init__(self, mask: bytes) -> None:
        self.mask = mask

    def compute_bitmask(self) -> bytes:
        return self.mask


def test_guide_reads_its_mask_as_a_plain_reference_does():
    rng = np.random.default_rng(0)
    vocab = 70  # the last byte only partly used, as with a real vocabulary
    mask = bytes(rng.integers(0, 256, 9, dtype=np.uint8))
    with ThreadPoolExecutor(1) as pool:
        guide = Guide(_Known(mask), pool)
        mask_of_guide = guide.allowed(vocab)
        assert mask_of_guide.dtype == torch.bool and mask_of_guide.shape == (vocab,)
        for t in range(vocab):
            allowed = (mask[t // 8] >> (t % 8)) & 1
            assert guide.allows(t) == bool(allowed)
            assert mask_of_guide[t].item() == bool(allowed)
        assert not guide.allows(9 * 8)  # past the mask


def test_sampler_keeps_an_allowed_maximum_and_otherwise_draws_within_the_language():
    vocab = 16
    logits = torch.zeros(3, vocab)
    logits[:, 5] = 3.0  # every row's maximum is token 5
    logits[:, 9] = 2.0
    only_9 = bytes([0, 0b10])  # token 9 alone
    with ThreadPoolExecutor(1) as pool:
        allow_5 = Guide(_Known(bytes([0b100000, 0])), pool)
        allow_9 = Guide(_Known(only_9), pool)
        greedy = SamplerState.create(SamplingParams())
        hot = SamplerState.create(SamplingParams(temperature=1.0, seed=1))
        tokens = sample(logits, [greedy, greedy, hot], [allow_5, allow_9, allow_9])
        assert tokens == [5, 9, 9]
        nothing = Guide(_Known(bytes(2)), pool)
        (error,) = sample(logits[:1], [greedy], [nothing])
        assert isinstance(error, NoAllowedTokenError)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_rows_with_forbidden_maxima_take_the_allowed_maximum_row_by_row(dtype):
    """The batched masked reduction against the plain one-row-at-a-time computation: the first
    maximum of the float32 row with its forbidden tokens at -inf (float16: the penalty at
    forbidden tokens is that dtype's lowest value, not float32's)."""
    rng = np.random.default_rng(3)
    vocab, num_rows = 300, 6
    logits = torch.tensor(rng.normal(size=(num_rows, vocab)), dtype=dtype)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the first one wins
    logits[2, 3] = logits[2, 7] + 1  # its maximum, forbidden below
    logits[4, :] = float("-inf")
    logits[4, 0] = 1.0  # its only finite token is forbidden below
    masks = [bytes(rng.integers(0, 256, (vocab + 7) // 8, dtype=np.uint8)) for _ in logits]
    masks[2] = bytes([0b10000000, 0b10]) + bytes(len(masks[2]) - 2)  # tokens 7 and 9
    masks[4] = bytes([0b11111110]) + masks[4][1:]
    with ThreadPoolExecutor(1) as pool:
        guides = [Guide(_Known(m), pool) for m in masks]
        greedy = SamplerState.create(SamplingParams())
        tokens = sample(logits, [greedy] * num_rows, guides)
    for row, mask, token in zip(logits, masks, tokens, strict=True):
        allowed = np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little", count=vocab)
        masked = row.float().masked_fill(torch.from_numpy(allowed == 0), float("-inf"))
        if masked.max() == float("-inf"):
            assert isinstance(token, NoAllowedTokenError)
        else:
            assert token == int(masked.argmax())
    assert tokens[2] == 7


def test_forbidden_maxima_are_stepped_over_before_the_whole_mask_is_read(monkeypatch):
    """A row whose next maximum is allowed takes it after a round or two; only a row whose
    first ``NEXT_MAXIMA + 1`` maxima are all forbidden reads its whole mask."""
    vocab = 64
    logits = torch.arange(vocab, dtype=torch.float32).flip(0).repeat(3, 1)  # token 0 is best
    allow = [set(range(1, vocab)), set(range(2, vocab)), set(range(sampling.NEXT_MAXIMA + 1, 40))]
    masks = [bytes(np.packbits([t in a for t in range(vocab)], bitorder="little")) for a in allow]
    whole_mask_rows = []
    masked_max = sampling._masked_max

    def counted(logits, rows, packed):
        whole_mask_rows.extend(rows)
        return masked_max(logits, rows, packed)

    monkeypatch.setattr(sampling, "_masked_max", counted)
    with ThreadPoolExecutor(1) as pool:
        guides = [Guide(_Known(m), pool) for m in masks]
        greedy = SamplerState.create(SamplingParams())
        tokens = sample(logits, [greedy] * 3, guides)
    assert tokens == [1, 2, sampling.NEXT_MAXIMA + 1]
    assert whole_mask_rows == [2]


def test_every_kind_of_language(engine):
    text, outs = _run(engine, StructuredOutput("json_schema", json.dumps(SCHEMA)))
    jsonschema.validate(json.loads(text), SCHEMA)
    assert outs[-1].finish_reason == FinishReason.STOP
    text, _ = _run(engine, StructuredOutput("regex", REGEX))
    assert re.fullmatch(REGEX, text), text
    for i in range(3):
        text, _ = _run(engine, StructuredOutput.choice(CHOICES), prompt=f"pick {i}")
        assert text in CHOICES
    text, _ = _run(engine, StructuredOutput("grammar", LARK))
    assert re.fullmatch(r"yes|no|maybe [0-9]", text), text
    text, _ = _run(engine, StructuredOutput("grammar", GBNF))
    assert text in ("up", "down")
    # any JSON object: random weights rarely close one in a few tokens, but what came out is
    # the start of one
    text, outs = _run(engine, StructuredOutput("json_object"), max_new_tokens=6)
    assert text.startswith("{")


def test_sampled_rows_stay_in_the_language(engine):
    for seed in range(4):
        text, _ = _run(
            engine, StructuredOutput("regex", REGEX), prompt=f"s{seed}", temperature=1.0, seed=seed
        )
        assert re.fullmatch(REGEX, text), text


def test_guided_and_free_requests_share_a_batch(engine, h):
    free = engine.tokenize_messages([{"role": "user", "content": "free"}])
    engine.add_request("free", SamplingParams(max_new_tokens=8), free)
    guided = engine.tokenize_messages([{"role": "user", "content": "guided"}])
    engine.add_request(
        "guided",
        SamplingParams(max_new_tokens=8, structured=StructuredOutput("regex", REGEX)),
        guided,
    )
    outs = run_to_completion(engine)
    assert re.fullmatch(REGEX, "".join(o.text for o in outs["guided"]))
    ref = h.ref.generate(h.ref.build_inputs("free", []), 8)
    assert tokens_of(outs["free"]) == ref


@pytest.mark.parametrize(
    ("structured", "words"),
    [
        (StructuredOutput("json_schema", "{not json"), "json_schema is not valid JSON"),
        (StructuredOutput("json_schema", "[1, 2]"), "json_schema must be a JSON object"),
        (StructuredOutput("json_schema", '{"type": "nonsense"}'), "json_schema"),
        (StructuredOutput("regex", "(a|"), "regex is not usable"),
        (StructuredOutput("grammar", "start: {{"), "grammar is not usable"),
        (StructuredOutput("grammar", "root ::= (("), "grammar"),
        (StructuredOutput("choice", "[]"), "choice needs 1 to"),
    ],
)
def test_unusable_languages_are_refused_naming_the_field(engine, structured, words):
    inputs = engine.tokenize_messages([{"role": "user", "content": "x"}])
    with pytest.raises(RequestError) as info:
        engine.add_request("bad", SamplingParams(structured=structured), inputs)
    assert info.value.kind == ErrorKind.INVALID_ARGUMENT
    assert f"sampling.structured_output.{structured.kind}" in str(info.value)
    assert words in str(info.value)
    assert "bad" not in engine.requests


def test_the_field_checks_kind_and_size():
    with pytest.raises(ValueError, match="structured_output must be one of"):
        StructuredOutput("yaml", "x")
    with pytest.raises(ValueError, match="more than the limit"):
        StructuredOutput("regex", "a" * (1 << 17))


class _Enforce:
    """transformers logits processor: the same language, its own matcher and mask unpacking."""

    def __init__(self, matcher, vocab_size: int, prompt_len: int) -> None:
        import llguidance.numpy as lnp

        self.lnp, self.matcher, self.vocab, self.prompt_len = lnp, matcher, vocab_size, prompt_len

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        bitmask = self.lnp.allocate_token_bitmask(1, self.vocab)
        self.lnp.fill_next_token_bitmask(self.matcher, bitmask, 0)
        bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: scores.shape[1]]
        return scores.masked_fill(torch.from_numpy(bits == 0), float("-inf"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["json_schema", "regex"])
def test_greedy_equals_transformers_with_the_language_enforced(harness, arch, kind):
    import llguidance
    from transformers import LogitsProcessorList

    from services.language.engine.grammar import to_grammar

    h = harness(arch)
    engine = h.engine()
    spec = json.dumps(SCHEMA) if kind == "json_schema" else REGEX
    structured = StructuredOutput(kind, spec)
    ref_inputs = h.ref.build_inputs("describe it", [])
    ids = ref_inputs.input_ids
    matcher = llguidance.LLMatcher(engine.grammars.tokenizer(), to_grammar(structured))
    vocab = engine.model_config.vocab_size
    out = h.ref.model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=ref_inputs.mm_token_type_ids,
        max_new_tokens=40,
        do_sample=False,
        logits_processor=LogitsProcessorList([_Enforce(matcher, vocab, ids.shape[1])]),
    )
    expected = out[0, ids.shape[1] :].tolist()
    eos = set(engine.model_config.eos_token_ids)
    while expected and expected[-1] in eos:  # the engine ends when the language does
        expected.pop()
    text, outs = _run(engine, structured, prompt="describe it", max_new_tokens=40)
    assert tokens_of(outs) == expected
    assert outs[-1].finish_reason == FinishReason.STOP


def test_with_penalties_bias_and_logprobs(engine):
    """The controls and the language compose: a bias toward a token the language forbids does
    not let it in, penalties change nothing about the language, log-probabilities stay the
    model's (the chosen token's equals its entry in the top list)."""
    digit = engine.tokenizer.convert_tokens_to_ids("7")
    letter = engine.tokenizer.convert_tokens_to_ids("x")
    text, outs = _run(
        engine,
        StructuredOutput("regex", "[0-9]{4}"),
        logit_bias=((letter, 100.0), (digit, 5.0)),
        frequency_penalty=1.5,
        presence_penalty=0.5,
        repetition_penalty=1.3,
        logprobs=True,
        top_logprobs=3,
    )
    assert re.fullmatch("[0-9]{4}", text), text
    for out in outs:
        for lp in out.logprobs:
            assert lp.logprob <= 0.0
            assert all(t.token_id != lp.token_id or t.logprob == lp.logprob for t in lp.top)
