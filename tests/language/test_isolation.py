"""One request's failure finishes that request alone; the others stream on (qwen2_5_vl).

Each test runs a long greedy answer next to a request forced to fail in one place (its image
rows, its sampler, its inputs) and checks the long one token for token against transformers.
"""

from __future__ import annotations

import math

import pytest
import torch

from services.language.engine.request import ErrorKind, FinishReason
from services.language.engine.sampling import SamplingParams
from tests.language.conftest import failing_on_call, make_image, run_to_completion, tokens_of

LONG = 24


@pytest.fixture(scope="module")
def h(harness):
    return harness("qwen2_5_vl")


@pytest.fixture(scope="module")
def long_case(h):
    return h.case("tell me a long story about the picture", [make_image(64, 48, 3)], LONG)


@pytest.fixture(scope="module")
def image_case(h):
    return h.case("what is this", [make_image(80, 60, 4)], 8)


def assert_nothing_held(engine):
    cm = engine.cache_manager
    info = cm.cache.size_info()
    assert not engine.requests and info.protected_size == 0
    assert cm.num_used == info.evictable_size
    cm.cache.check_integrity()


def run_pair(engine, long_case, bad_inputs, bad_params=None):
    engine.add_request("long", SamplingParams(max_new_tokens=LONG), long_case.inputs)
    engine.add_request("bad", bad_params or SamplingParams(max_new_tokens=8), bad_inputs)
    return run_to_completion(engine)


def test_nan_image_rows_fail_their_request_only(h, long_case, image_case):
    bad = image_case.inputs
    rows = bad.image_rows.clone()
    rows[3, 5] = math.nan
    poisoned = type(bad)(bad.fill_ids, bad.positions, rows, bad.mrope_delta, images=bad.images)
    engine = h.engine(chunk_size=64)
    outputs = run_pair(engine, long_case, poisoned)
    assert tokens_of(outputs["long"]) == long_case.expected
    assert outputs["long"][-1].finish_reason == FinishReason.LENGTH
    final = outputs["bad"][-1]
    assert final.finish_reason == FinishReason.ERROR and final.error_kind == ErrorKind.FAILED
    assert "non-finite logits" in final.error
    assert_nothing_held(engine)
    # The poisoned prompt's K/V was not cached: the clean one computes its image again.
    engine.add_request("clean", SamplingParams(max_new_tokens=8), image_case.inputs)
    clean = run_to_completion(engine)["clean"]
    assert tokens_of(clean) == image_case.expected
    first_image_token = int((bad.fill_ids >= engine.model_config.vocab_size).nonzero()[0])
    assert clean[-1].num_cached_tokens <= first_image_token


def test_a_sampler_that_raises_fails_its_request_only(h, long_case, image_case):
    engine = h.engine(chunk_size=64)
    params = SamplingParams(max_new_tokens=8, temperature=0.8, seed=3)
    engine.add_request("long", SamplingParams(max_new_tokens=LONG), long_case.inputs)
    engine.add_request("bad", params, image_case.inputs)
    outputs: dict[str, list] = {}
    for _ in range(4):  # let "bad" start decoding, then break its sampler
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)

    def broken(*args):
        raise RuntimeError("sampler state corrupted")

    # the row's draw: its uniform on the native sampler, its own sample() on torch's
    engine.requests["bad"].sampler.sample = broken
    engine.requests["bad"].sampler.uniform = broken
    for rid, outs in run_to_completion(engine).items():
        outputs.setdefault(rid, []).extend(outs)
    assert tokens_of(outputs["long"]) == long_case.expected
    final = outputs["bad"][-1]
    assert final.finish_reason == FinishReason.ERROR
    assert "sampling failed: sampler state corrupted" in final.error
    assert_nothing_held(engine)


def test_inputs_that_cannot_be_gathered_fail_their_request_only(h, long_case, image_case):
    engine = h.engine(chunk_size=64)
    engine.add_request("long", SamplingParams(max_new_tokens=LONG), long_case.inputs)
    engine.add_request("bad", SamplingParams(max_new_tokens=8), image_case.inputs)

    def broken(start, end):
        raise IndexError("positions out of range")

    engine.requests["bad"].positions = broken
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["long"]) == long_case.expected
    final = outputs["bad"][-1]
    assert final.finish_reason == FinishReason.ERROR and "positions out of range" in final.error
    assert_nothing_held(engine)


def test_a_failed_forward_fails_its_batch_and_the_engine_goes_on(h, long_case, image_case):
    # the eager forward (a CUDA-graph step's failure: tests/language/test_decode_graphs.py)
    engine = h.engine(max_running_requests=1, cuda_graphs=False)
    engine.add_request("first", SamplingParams(max_new_tokens=8), image_case.inputs)
    engine.add_request("queued", SamplingParams(max_new_tokens=LONG), long_case.inputs)
    model = engine.runner.model
    model.forward = failing_on_call(model.forward, 2, RuntimeError("device lost"))
    outputs = run_to_completion(engine)
    final = outputs["first"][-1]
    assert final.finish_reason == FinishReason.ERROR and "device lost" in final.error
    assert tokens_of(outputs["queued"]) == long_case.expected  # not in the failed batch
    assert_nothing_held(engine)


def test_prompt_longer_than_max_seq_len_is_refused_naming_both_numbers(h, image_case):
    prompt_len = len(image_case.inputs)
    engine = h.engine(max_seq_len=prompt_len + 10)
    assert engine.max_seq_len == prompt_len + 10
    with pytest.raises(ValueError) as err:
        engine.add_request("big", SamplingParams(max_new_tokens=11), image_case.inputs)
    total = prompt_len + 11
    assert str(err.value) == (
        f"prompt is {prompt_len} tokens and max_new_tokens is 11: {total} exceeds this "
        f"worker's max_seq_len {prompt_len + 10}"
    )
    assert not engine.requests
    # A room whose prompt turns out too long finishes with that message.
    engine.add_request("room", SamplingParams(max_new_tokens=11), room=9)
    [out] = engine.deliver_inputs(9, image_case.inputs)
    assert out.finish_reason == FinishReason.ERROR
    assert out.error_kind == ErrorKind.INVALID_ARGUMENT and f"{total} exceeds" in out.error
    # Unset max_new_tokens: the default shrinks to what fits.
    engine.add_request("fits", SamplingParams(max_new_tokens=None, ignore_eos=True),
                       image_case.inputs)  # fmt: skip
    outputs = run_to_completion(engine)["fits"]
    assert len(tokens_of(outputs)) == 10
    assert outputs[-1].finish_reason == FinishReason.LENGTH
    assert_nothing_held(engine)
    full = h.engine(max_seq_len=prompt_len)
    with pytest.raises(ValueError) as err:
        full.add_request("full", SamplingParams(max_new_tokens=None), image_case.inputs)
    assert str(err.value) == (
        f"prompt is {prompt_len} tokens: with a new token it exceeds this worker's "
        f"max_seq_len {prompt_len}"
    )


def test_room_failing_past_its_deadline_is_deadline_exceeded(h):
    engine = h.engine()
    engine.add_request("late", SamplingParams(), room=11, deadline=0.0)  # long past
    [out] = engine.deliver_inputs(11, RuntimeError("room 11: deadline: request deadline passed"))
    assert out.error_kind == ErrorKind.DEADLINE_EXCEEDED
    engine.add_request("dead", SamplingParams(), room=12, deadline=1e12)
    [out] = engine.deliver_inputs(12, RuntimeError("room 12: sender_dead"))
    assert out.error_kind == ErrorKind.FAILED and "sender_dead" in out.error


def test_rows_of_the_wrong_shape_are_refused(h, image_case):
    engine = h.engine()
    bad = image_case.inputs
    narrow = type(bad)(bad.fill_ids, bad.positions, bad.image_rows[:, :-1], bad.mrope_delta)
    with pytest.raises(ValueError, match="needs width"):
        engine.add_request("narrow", SamplingParams(), narrow)
    short = type(bad)(bad.fill_ids, bad.positions, bad.image_rows[1:], bad.mrope_delta)
    with pytest.raises(ValueError, match="image tokens but"):
        engine.add_request("short", SamplingParams(), short)
    negative = bad.fill_ids.clone()
    negative[0] = -1
    with pytest.raises(ValueError, match="negative"):
        engine.add_request(
            "neg", SamplingParams(), type(bad)(negative, bad.positions, bad.image_rows, 0)
        )
    assert not engine.requests


def test_wire_dtype_rows_are_cast_to_the_model_dtype(h, image_case):
    """Rows arrive in bf16 (the wire dtype); an fp32 engine casts them on use."""
    bad = image_case.inputs
    as_wire = bad.image_rows.to(torch.bfloat16)
    wire = type(bad)(bad.fill_ids, bad.positions, as_wire, bad.mrope_delta, images=bad.images)
    rounded = type(bad)(
        bad.fill_ids, bad.positions, as_wire.float(), bad.mrope_delta, images=bad.images
    )
    engine = h.engine()
    engine.add_request("wire", SamplingParams(max_new_tokens=8), wire)
    engine.add_request("rounded", SamplingParams(max_new_tokens=8), rounded)
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["wire"]) == tokens_of(outputs["rounded"])
    assert len(tokens_of(outputs["wire"])) == 8


def test_a_room_with_unforeseen_bad_inputs_fails_alone(h, image_case):
    engine = h.engine()
    bad = image_case.inputs
    broken = type(bad)(bad.fill_ids, bad.positions, bad.image_rows, 0, images=("not a ref",))
    engine.add_request("odd", SamplingParams(max_new_tokens=4), room=5)
    [out] = engine.deliver_inputs(5, broken)
    assert out.finish_reason == FinishReason.ERROR and out.error_kind == ErrorKind.FAILED
    assert "could not be taken" in out.error
    assert not engine.requests and not engine.receiving
    engine.add_request("fine", SamplingParams(max_new_tokens=8), image_case.inputs)
    assert tokens_of(run_to_completion(engine)["fine"]) == image_case.expected
