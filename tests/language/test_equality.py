"""Greedy tokens of the language engine == transformers' monolithic generate, per architecture."""

from __future__ import annotations

import pytest
import torch

from common.linear_kernels import onednn_usable
from common.native_kernels import load_native_kernels
from services.language.engine.sampling import SamplingParams
from tests.conftest import ARCHS
from tests.language.conftest import generate, make_image, run_to_completion, tokens_of

PROMPT = "describe this picture in detail"
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=ARCHS)
def h(request, harness):
    return harness(request.param)


def test_text_only(h):
    case = h.case("hello there, who are you?", [], 12)
    assert generate(h.engine(), case.inputs, 12)[0] == case.expected


def test_one_image(h):
    case = h.case(PROMPT, [make_image(64, 48, 1)], 12)
    assert generate(h.engine(), case.inputs, 12)[0] == case.expected


def test_three_images(h):
    images = [make_image(64, 48, 1), make_image(100, 60, 2), make_image(40, 90, 3)]
    case = h.case(PROMPT, images, 12)
    assert len(case.inputs.image_rows) > 0
    assert generate(h.engine(), case.inputs, 12)[0] == case.expected


def test_long_image_prompt_in_chunks_that_cut_images(h):
    case = h.case(PROMPT, [make_image(1100, 1100, 4)], 8)
    assert len(case.inputs) > 1024
    # 100-token chunks: the image starts a few tokens in, so nearly every chunk cuts it.
    engine = h.engine(chunk_size=100)
    assert generate(engine, case.inputs, 8)[0] == case.expected


def test_chunk_cuts_small_image(h):
    case = h.case(PROMPT, [make_image(64, 48, 1), make_image(100, 60, 2)], 8)
    engine = h.engine(chunk_size=7)
    assert generate(engine, case.inputs, 8)[0] == case.expected


def test_mixed_batch_concurrent(h):
    cases = [
        h.case("just text here", [], 10),
        h.case(PROMPT, [make_image(64, 48, 1)], 10),
        h.case("what differs?", [make_image(64, 48, 5), make_image(80, 80, 6)], 10),
        h.case("just text here", [], 10),
    ]
    engine = h.engine(chunk_size=32)
    for i, case in enumerate(cases):
        engine.add_request(f"m{i}", SamplingParams(max_new_tokens=10), case.inputs)
    outputs = run_to_completion(engine)
    for i, case in enumerate(cases):
        assert tokens_of(outputs[f"m{i}"]) == case.expected


def test_same_request_twice_hits_radix(h):
    case = h.case(PROMPT, [make_image(120, 90, 7)], 8)
    engine = h.engine()
    first, out1 = generate(engine, case.inputs, 8)
    second, out2 = generate(engine, case.inputs, 8)
    assert first == second == case.expected
    assert out1.num_cached_tokens == 0
    assert out2.num_cached_tokens >= 0.9 * len(case.inputs)
    engine.cache_manager.cache.check_integrity()


def test_evicted_prefix_is_recomputed(h):
    a = h.case(PROMPT, [make_image(224, 224, 8)], 8)
    b = h.case("another question", [make_image(224, 200, 9)], 8)
    engine = h.engine(num_kv_slots=max(len(a.inputs), len(b.inputs)) + 16)
    assert generate(engine, a.inputs, 8)[0] == a.expected
    assert generate(engine, b.inputs, 8)[0] == b.expected  # evicts most of a's prefix
    again, out = generate(engine, a.inputs, 8)
    assert again == a.expected
    assert out.num_cached_tokens < 0.5 * len(a.inputs)
    engine.cache_manager.cache.check_integrity()


def test_preemption_under_slot_pressure(h):
    cases = [h.case(f"{PROMPT} {i}", [make_image(64, 48, 10 + i)], 12) for i in range(3)]
    longest = max(len(c.inputs) for c in cases)
    engine = h.engine(num_kv_slots=longest + longest // 2 + 12, chunk_size=64)
    for i, case in enumerate(cases):
        engine.add_request(f"p{i}", SamplingParams(max_new_tokens=12), case.inputs)
    outputs = run_to_completion(engine)
    for i, case in enumerate(cases):
        assert tokens_of(outputs[f"p{i}"]) == case.expected
    assert engine.scheduler.num_preemptions > 0
    info = engine.cache_manager.cache.size_info()
    assert info.protected_size == 0
    assert engine.cache_manager.num_used == info.evictable_size


def test_fast_cpu_kernels_are_the_default_in_float32(h):
    """``auto`` in float32 on a CPU: linears prepacked for oneDNN (products summed in another
    order than MKL's), the native RMSNorm (a row's sum of squares in another order) and, where
    the GQA group fits it, decode attention read in the pool in place: values move by ~1e-7,
    and the greedy tokens stay transformers' (every test above runs this path)."""
    kernels, _ = load_native_kernels()
    engine = h.engine()
    mc = engine.model_config
    assert engine.linear_kernel == ("onednn" if onednn_usable(CPU, torch.float32)[0] else "plain")
    assert engine.cpu_kernels == ("torch" if kernels is None else "native")
    if kernels is not None:
        assert (engine.runner.decode_kernels is not None) == kernels.decode_attention_fits(
            engine.dtype, mc.num_heads, mc.num_kv_heads, mc.head_dim
        )


@pytest.mark.parametrize("chunk_size", [7, 512])
def test_reference_kernels_in_float32(h, chunk_size):
    """The reference path (``F.linear`` on the loaded weights, torch's ops) still gives
    transformers' greedy tokens, in small chunks that cut images and in one."""
    engine = h.engine(linear_kernel="plain", cpu_kernels="torch", chunk_size=chunk_size)
    assert (engine.linear_kernel, engine.cpu_kernels) == ("plain", "torch")
    assert engine.runner.decode_kernels is None
    cases = [
        h.case("hello there, who are you?", [], 12),
        h.case(PROMPT, [make_image(64, 48, 1), make_image(100, 60, 2)], 12),
    ]
    for i, case in enumerate(cases):
        engine.add_request(f"ref{i}", SamplingParams(max_new_tokens=12), case.inputs)
    outputs = run_to_completion(engine)
    for i, case in enumerate(cases):
        assert tokens_of(outputs[f"ref{i}"]) == case.expected
