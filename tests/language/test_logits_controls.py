"""The logits controls in the engine (qwen2_5_vl, fp32): greedy tokens with penalties and a bias
equal a step-by-step greedy loop over transformers' own logits with the reference formulas; a
penalty breaks a greedy loop; a bias forces a token; min_tokens decodes past a forced EOS;
log-probabilities stay the model's; a bias id outside the vocabulary is refused."""

from __future__ import annotations

import pytest
import torch

from services.language.engine.request import FinishReason
from services.language.engine.sampling import SamplingParams
from tests.language.conftest import generate, make_image, run_to_completion, tokens_of
from tests.language.test_penalties import reference

STEPS = 12
REF_STEPS = 40  # long enough for the plain continuation to repeat tokens


@pytest.fixture(scope="module")
def h(harness):
    return harness("qwen2_5_vl")


@pytest.fixture(scope="module")
def text_case(h):
    return h.case("hello there, who are you?", [], STEPS)


@pytest.fixture(scope="module")
def image_case(h):
    return h.case("tell me a story", [make_image(64, 48, 1)], STEPS)


@torch.no_grad()
def hf_greedy_with_controls(
    h, case, params: SamplingParams, steps: int, eos: tuple[int, ...]
) -> list[int]:
    """Greedy decoding of a text-only prompt with transformers' model (no cache: the whole
    sequence each step), the controls applied to its last logits by ``reference``."""
    prompt = case.ref_inputs.input_ids[0].tolist()
    output: list[int] = []
    for _ in range(steps):
        ids = torch.tensor([prompt + output])
        logits = h.ref.model(
            input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=ids * 0
        ).logits[0, -1]
        row = reference(logits.float().tolist(), params, prompt, output, eos)
        output.append(max(range(len(row)), key=row.__getitem__))
    return output


@pytest.fixture(scope="module")
def engine(h):
    return h.engine()


def test_neutral_controls_keep_transformers_greedy_tokens(engine, image_case):
    # a zero bias and neutral penalties take the processing path without changing anything
    neutral = dict(logit_bias=((5, 0.0),), repetition_penalty=1.0, frequency_penalty=0.0)
    assert generate(engine, image_case.inputs, STEPS, **neutral)[0] == image_case.expected


@pytest.mark.parametrize(
    "controls",
    [
        dict(repetition_penalty=1.7),
        dict(frequency_penalty=0.8, presence_penalty=0.3),
        dict(
            repetition_penalty=0.6,
            frequency_penalty=-0.5,
            presence_penalty=1.2,
            logit_bias=((11, 0.05), (300, -0.02)),
        ),
    ],
    ids=["repetition", "frequency+presence", "combined"],
)
def test_greedy_with_controls_equals_the_reference_loop(h, engine, text_case, controls):
    eos = engine.model_config.eos_token_ids
    params = SamplingParams(max_new_tokens=REF_STEPS, ignore_eos=True, **controls)
    expected = hf_greedy_with_controls(h, text_case, params, REF_STEPS, eos)
    plain = SamplingParams(max_new_tokens=REF_STEPS, ignore_eos=True)
    assert expected != hf_greedy_with_controls(h, text_case, plain, REF_STEPS, eos)
    tokens = generate(engine, text_case.inputs, REF_STEPS, ignore_eos=True, **controls)[0]
    assert tokens == expected


def test_a_big_penalty_breaks_a_greedy_loop(engine, image_case):
    plain = generate(engine, image_case.inputs, 64, ignore_eos=True)[0]
    assert len(set(plain)) < len(plain)  # random weights come back to the same tokens
    penalized = generate(
        engine, image_case.inputs, 64, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0
    )[0]
    assert len(set(penalized)) == len(penalized)
    assert penalized[0] == plain[0]  # nothing generated yet: the prompt is not penalized


def test_a_bias_forces_a_token(engine, image_case):
    tokens, _ = generate(engine, image_case.inputs, 3, logit_bias=((123, 100.0),))
    assert tokens == [123] * 3


def test_logprobs_of_a_biased_token_are_the_raw_models(h, engine, image_case):
    forced = 123
    engine.add_request(
        "lp",
        SamplingParams(max_new_tokens=1, logit_bias=((forced, 100.0),), logprobs=True),
        image_case.inputs,
    )
    [out] = run_to_completion(engine)["lp"]
    raw = h.ref.next_token_logprobs(image_case.ref_inputs)
    assert out.token_ids == [forced]
    assert out.logprobs[0].logprob == pytest.approx(float(raw[forced]), abs=1e-4)
    assert out.logprobs[0].logprob < float(raw.max()) - 1  # not the biased distribution's ~0


def test_min_tokens_decodes_past_a_forced_eos(engine, image_case):
    eos = engine.model_config.eos_token_ids[0]
    bias = ((eos, 100.0),)
    tokens, out = generate(engine, image_case.inputs, 10, logit_bias=bias)
    assert tokens == [eos] and out.finish_reason == FinishReason.STOP
    tokens, out = generate(engine, image_case.inputs, 10, logit_bias=bias, min_tokens=4)
    assert len(tokens) == 5 and eos not in tokens[:4] and tokens[4] == eos
    assert out.finish_reason == FinishReason.STOP


def test_a_controlled_request_beside_a_plain_one(engine, image_case, text_case):
    engine.add_request("plain", SamplingParams(max_new_tokens=STEPS), image_case.inputs)
    engine.add_request(
        "biased",
        SamplingParams(max_new_tokens=STEPS, logit_bias=((77, 100.0),), min_tokens=2),
        text_case.inputs,
    )
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["plain"]) == image_case.expected
    assert tokens_of(outputs["biased"]) == [77] * STEPS


def test_a_bias_id_outside_the_vocabulary_is_refused(engine, text_case):
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"sampling.logit_bias .*\[0, {vocab}\).*got {vocab}"):
        engine.add_request("oov", SamplingParams(logit_bias=((vocab, 1.0),)), text_case.inputs)
    assert "oov" not in engine.requests


def test_min_tokens_holds_off_stop_strings(engine, image_case):
    full = engine.tokenizer.decode(image_case.expected, skip_special_tokens=True)
    stop = next(full[i : i + 2] for i in range(len(full) // 2) if full[i : i + 2].strip())
    tokens, out = generate(engine, image_case.inputs, STEPS, stop=(stop,))
    assert out.finish_reason == FinishReason.STOP and len(tokens) < STEPS
    params = SamplingParams(max_new_tokens=STEPS, stop=(stop,), min_tokens=STEPS)
    engine.add_request("late-stop", params, image_case.inputs)
    outs = run_to_completion(engine)["late-stop"]
    assert tokens_of(outs) == image_case.expected
    assert "".join(o.text for o in outs) == full
    assert outs[-1].finish_reason == FinishReason.LENGTH
