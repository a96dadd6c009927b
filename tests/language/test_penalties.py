"""``penalties.process_logits`` against a plain reference of the same formulas (a Python loop
over a small vocabulary), min-p in the sampler, and the new ``SamplingParams`` bounds."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from services.language.engine.penalties import process_logits
from services.language.engine.request import Request
from services.language.engine.sampling import SamplerState, SamplingParams, sample
from services.language.inputs import PromptInputs

VOCAB = 64
EOS = (7, 9)


def make_request(prompt: list[int], output: list[int], **params: object) -> Request:
    """A request whose prompt is ``prompt`` and that generated ``output`` so far."""
    req = Request("r", SamplingParams(max_new_tokens=100, **params), detokenizer=None)
    req.inputs = PromptInputs.from_text_ids(prompt, hidden_size=4)
    req.num_prompt_tokens = len(prompt)
    req.output_ids = list(output)
    req.sampler = SamplerState.create(req.params)
    return req


def reference(
    row: list[float],
    p: SamplingParams,
    prompt: list[int],
    output: list[int],
    eos: tuple[int, ...] = EOS,
) -> list[float]:
    """The controls of ``p`` applied to one row, token by token, in vLLM's order, after the
    ``prompt`` and ``output`` tokens so far."""
    out = list(row)
    for token_id, bias in p.logit_bias:
        out[token_id] += bias
    if len(output) < p.min_tokens:
        masked = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
        for t in masked:
            if t < len(out):
                out[t] = -math.inf
    seen = {t for t in prompt if 0 <= t < len(out)} | set(output)
    for t in range(len(out)):
        if t in seen:
            r = p.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        count = output.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def random_request(rng: random.Random, **params: object) -> Request:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
    prompt.append(VOCAB + 5)  # an image placeholder: not a token, not penalized
    output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 30))]
    return make_request(prompt, output, **params)


SETTINGS = {
    "frequency": dict(frequency_penalty=1.5),
    "negative frequency": dict(frequency_penalty=-0.7),
    "presence": dict(presence_penalty=2.0),
    "repetition": dict(repetition_penalty=1.8),
    "repetition below 1": dict(repetition_penalty=0.5),
    "bias": dict(logit_bias=((3, 5.0), (10, -100.0), (63, 0.25))),
    "min_tokens": dict(min_tokens=50, stop_token_ids=(11, 200)),
    "min_tokens ignore_eos": dict(min_tokens=50, stop_token_ids=(11,), ignore_eos=True),
    "all": dict(
        frequency_penalty=0.4,
        presence_penalty=-1.1,
        repetition_penalty=1.3,
        logit_bias=((7, 3.0), (2, -4.0)),
        min_tokens=50,
    ),
}


def check(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    raw = logits.clone()
    out = process_logits(logits, requests, EOS)
    assert torch.equal(logits, raw)  # the model's logits are never written
    for i, req in enumerate(requests):
        prompt = req.inputs.fill_ids.tolist()
        expected = reference(raw[i].tolist(), req.params, prompt, req.output_ids)
        expected = np.array(expected, dtype=np.float32)
        np.testing.assert_allclose(out[i].numpy(), expected, rtol=1e-6, atol=1e-5)
    return out


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_control_alone_equals_the_reference(name: str) -> None:
    rng = random.Random(name)
    for seed in range(5):
        requests = [random_request(rng, **SETTINGS[name]) for _ in range(3)]
        logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
        check(logits, requests)


def test_mixed_batch_each_row_its_own_settings_and_plain_rows_untouched() -> None:
    rng = random.Random(7)
    names = [*SETTINGS, "plain", "plain"]
    rng.shuffle(names)
    for step in range(4):
        requests = [random_request(rng, **SETTINGS.get(name, {})) for name in names]
        logits = torch.randn(len(names), VOCAB, generator=torch.Generator().manual_seed(step))
        out = check(logits, requests)
        for i, name in enumerate(names):
            if name == "plain":
                assert torch.equal(out[i], logits[i])


def test_history_follows_new_tokens_one_step_at_a_time() -> None:
    rng = random.Random(3)
    requests = [random_request(rng, **SETTINGS["all"]), random_request(rng, presence_penalty=1)]
    for step in range(6):  # the history is built once and then updated incrementally
        logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(step))
        check(logits, requests)
        for req in requests:
            req.output_ids.append(rng.randrange(VOCAB))
    assert all(req.token_history.num_counted == len(req.output_ids) - 1 for req in requests)


def test_no_control_returns_the_logits_themselves() -> None:
    logits = torch.randn(2, VOCAB)
    requests = [make_request([1, 2], [3]), make_request([4], [], temperature=1.0, min_p=0.5)]
    assert process_logits(logits, requests, EOS) is logits
    assert all(req.token_history is None for req in requests)


def test_bf16_logits_are_processed_in_float32() -> None:
    logits = torch.randn(2, VOCAB).to(torch.bfloat16)
    requests = [make_request([1], [2, 2], frequency_penalty=0.3), make_request([1], [])]
    out = process_logits(logits, requests, EOS)
    assert out.dtype == torch.float32
    assert torch.equal(out[1], logits[1].float())
    assert torch.isclose(out[0, 2], logits[0, 2].float() - 0.6)


def test_min_tokens_masks_stops_until_enough_tokens_then_stops_masking() -> None:
    req = make_request([1, 2], [], min_tokens=3, stop_token_ids=(11,))
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS[0]] = 10.0  # EOS would win greedy
    picked = []
    for _ in range(4):
        out = process_logits(logits, [req], EOS)
        masked = {t for t in range(VOCAB) if out[0, t] == -math.inf}
        assert masked == ({7, 9, 11} if len(req.output_ids) < 3 else set())
        [token] = sample(out, [req.sampler])
        picked.append(token)
        req.output_ids.append(token)
    assert picked[:3] != [7, 7, 7] and EOS[0] not in picked[:3] and picked[3] == EOS[0]


def test_a_bias_of_100_makes_greedy_pick_that_token() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1)) * 5
    requests = [make_request([1], [], logit_bias=((41, 100.0),)), make_request([1], [])]
    tokens = sample(process_logits(logits, requests, EOS), [r.sampler for r in requests])
    assert tokens == [41, int(logits[1].argmax())]


def test_min_p_drops_tokens_below_its_share_of_the_top_probability() -> None:
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    row = probs.log()
    for min_p, allowed in ((0.0, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0})):
        state = SamplerState.create(SamplingParams(temperature=1.0, min_p=min_p, seed=5))
        drawn = {state.sample(row) for _ in range(400)}
        assert drawn == allowed, min_p
    # a temperature sharpens the distribution before min-p compares (vLLM's order)
    state = SamplerState.create(SamplingParams(temperature=0.5, min_p=0.2, seed=5))
    assert {state.sample(row) for _ in range(400)} == {0, 1}  # 0.12² / 0.5² < 0.2
    greedy = SamplerState.create(SamplingParams(temperature=0.0, min_p=0.9))
    assert sample(row[None], [greedy]) == [0]


@pytest.mark.parametrize(
    ("kwargs", "field", "bound"),
    [
        (dict(frequency_penalty=2.5), "frequency_penalty", "[-2, 2]"),
        (dict(frequency_penalty=math.nan), "frequency_penalty", "[-2, 2]"),
        (dict(presence_penalty=-2.01), "presence_penalty", "[-2, 2]"),
        (dict(repetition_penalty=0.0), "repetition_penalty", "(0, 10]"),
        (dict(repetition_penalty=math.inf), "repetition_penalty", "(0, 10]"),
        (dict(min_p=1.5), "min_p", "[0, 1]"),
        (dict(min_p=math.nan), "min_p", "[0, 1]"),
        (dict(min_tokens=-1), "min_tokens", ">= 0"),
        (dict(min_tokens=9, max_new_tokens=8), "min_tokens", "max_new_tokens (8)"),
        (dict(logit_bias=((3, 100.5),)), "logit_bias", "[-100, 100]"),
        (dict(logit_bias=((3, math.nan),)), "logit_bias", "[-100, 100]"),
        (dict(logit_bias=((-3, 1.0),)), "logit_bias", ">= 0"),
        (dict(logit_bias=((3, 1.0), (3, 2.0))), "logit_bias", "twice"),
        (dict(logit_bias=tuple((i, 1.0) for i in range(301))), "logit_bias", "limit of 300"),
    ],
)
def test_out_of_range_controls_are_refused_naming_field_and_bound(kwargs, field, bound):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert field in str(err.value) and bound in str(err.value)


def test_control_bounds_themselves_are_accepted():
    SamplingParams(
        frequency_penalty=-2.0,
        presence_penalty=2.0,
        repetition_penalty=10.0,
        min_p=1.0,
        min_tokens=8,
        max_new_tokens=8,
        logit_bias=tuple((i, -100.0 if i % 2 else 100.0) for i in range(300)),
    )
    SamplingParams(min_tokens=1000, max_new_tokens=None)  # the worker's default decides
