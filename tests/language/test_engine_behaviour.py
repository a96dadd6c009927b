"""Sampling, stop conditions, abort and the receiving path of the engine (qwen2_5_vl)."""

from __future__ import annotations

import pytest

from services.language.engine.request import FinishReason, RequestStatus
from services.language.engine.sampling import SamplingParams
from tests.language.conftest import generate, make_image, run_to_completion, tokens_of


@pytest.fixture(scope="module")
def h(harness):
    return harness("qwen2_5_vl")


@pytest.fixture(scope="module")
def case(h):
    return h.case("tell me a story", [make_image(64, 48, 1)], 12)


def test_seeded_sampling_is_reproducible(h, case):
    engine = h.engine()
    kw = dict(temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    first = generate(engine, case.inputs, 12, **kw)[0]
    second = generate(engine, case.inputs, 12, **kw)[0]
    other = generate(engine, case.inputs, 12, temperature=1.0, seed=99)[0]
    assert first == second
    assert first != other  # a different seed gives another continuation
    assert all(0 <= t < engine.model_config.vocab_size for t in first)


def test_stop_token_and_stop_string(h, case):
    engine = h.engine()
    stop_token = case.expected[3]
    tokens, out = generate(engine, case.inputs, 12, stop_token_ids=(stop_token,))
    assert tokens == case.expected[: case.expected.index(stop_token) + 1]
    assert out.finish_reason == FinishReason.STOP
    full = engine.tokenizer.decode(case.expected, skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    engine2 = h.engine()
    engine2.add_request("s", SamplingParams(max_new_tokens=12, stop=(stop,)), case.inputs)
    outs = run_to_completion(engine2)["s"]
    assert outs[-1].finish_reason == FinishReason.STOP
    assert "".join(o.text for o in outs) == full[: full.index(stop)]


def test_streaming_text_and_usage(h, case):
    engine = h.engine()
    engine.add_request("t", SamplingParams(max_new_tokens=12), case.inputs)
    outs = run_to_completion(engine)["t"]
    assert tokens_of(outs) == case.expected
    assert "".join(o.text for o in outs) == engine.tokenizer.decode(
        case.expected, skip_special_tokens=True
    )
    final = outs[-1]
    assert final.finish_reason == FinishReason.LENGTH
    assert (final.num_prompt_tokens, final.num_completion_tokens) == (len(case.inputs), 12)
    assert all(not o.finished for o in outs[:-1])


def test_abort_in_every_state_frees_everything(h, case):
    engine = h.engine(chunk_size=8)
    engine.add_request("receiving", SamplingParams(), room=77)
    engine.add_request("waiting", SamplingParams(max_new_tokens=12), case.inputs)
    engine.add_request("decoding", SamplingParams(max_new_tokens=50), case.inputs)
    engine.step()  # "waiting" is now prefilling its first chunk
    assert engine.requests["waiting"].status == RequestStatus.PREFILL
    for _ in range(12):
        engine.step()
    assert engine.requests["decoding"].status == RequestStatus.DECODE
    for rid in ("receiving", "waiting", "decoding"):
        [out] = engine.abort(rid)
        assert out.finish_reason == FinishReason.ABORT and out.ends_request
    assert engine.abort("unknown") == []
    assert not engine.has_work() and not engine.requests
    cm = engine.cache_manager
    info = cm.cache.size_info()
    assert info.protected_size == 0
    assert cm.num_used == info.evictable_size
    cm.cache.check_integrity()


def test_embeddings_arriving_later(h, case):
    engine = h.engine()
    engine.add_request("late", SamplingParams(max_new_tokens=12), room=5)
    assert engine.load().num_receiving == 1
    assert engine.step() == []
    engine.deliver_inputs(5, case.inputs)
    outs = run_to_completion(engine)["late"]
    assert tokens_of(outs) == case.expected
    engine.add_request("failed", SamplingParams(), room=6)
    out = engine.deliver_inputs(6, RuntimeError("room 6: peer died"))[0]
    assert out.finish_reason == FinishReason.ERROR and "peer died" in out.error
    assert not engine.has_work()


def test_text_only_chat_template_tokenization(h):
    case = h.case("hello there", [], 8)
    engine = h.engine()
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    inputs = engine.tokenize_messages(messages)
    assert inputs.fill_ids.tolist() == case.ref_inputs.input_ids[0].tolist()
    assert generate(engine, inputs, 8)[0] == case.expected


def test_rejects_prompts_that_never_fit(h, case):
    engine = h.engine(num_kv_slots=len(case.inputs) + 4)
    with pytest.raises(ValueError):
        engine.add_request("big", SamplingParams(max_new_tokens=16), case.inputs)
    assert not engine.requests
