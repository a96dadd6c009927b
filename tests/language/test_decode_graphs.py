"""The decode step on static, padded inputs (``services/language/engine/decode_graphs.py``):
what a CUDA graph captures, run here eagerly (``capture=False``) so the CPU checks the packing,
the pad rows and keys, the scratch slot and the shape buckets against transformers. The captured
graphs themselves are checked on a GPU (``tests/cuda``)."""

from __future__ import annotations

import logging

import pytest
import torch

from services.language.config import LanguageConfig
from services.language.engine.decode_graphs import DecodeGraphs, batch_bucket, key_bucket
from services.language.engine.request import FinishReason
from services.language.engine.sampling import SamplingParams
from services.language.kvcache.pool import KVPool
from tests.language.conftest import failing_on_call, make_image, run_to_completion, tokens_of


@pytest.mark.parametrize(
    "rows,expected", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (17, 24)]
)
def test_batch_buckets(rows, expected):
    assert batch_bucket(rows, 64) == expected


def test_batch_buckets_stop_at_the_largest_batch():
    assert batch_bucket(12, 12) == 12  # not rounded past the most a graph runs
    assert batch_bucket(13, 12) is None
    assert batch_bucket(65, 64) is None


@pytest.mark.parametrize(
    "keys,expected", [(1, 256), (256, 256), (257, 512), (1000, 1024), (4097, 8192)]
)
def test_key_buckets(keys, expected):
    assert key_bucket(keys) == expected


def test_the_scratch_slot_is_past_the_allocators_slots_and_zero():
    pool = KVPool(2, 10, 2, 4, torch.float32, torch.device("cpu"))
    assert pool.scratch_slot == pool.num_slots == 10
    for layer in range(2):
        for cache in pool.layer(layer):
            assert cache.shape[0] == 11 and not cache[10].any()


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_static_decode_steps_match_transformers(harness, arch):
    """Three requests decode as a batch of four (one pad row), of different lengths (pad keys),
    the longest crossing from the 256-key bucket to the 512 one; a fourth joins midway (its
    prefill steps run eagerly, the others on static inputs). Greedy tokens == transformers'."""
    h = harness(arch)
    long_prompt = "count the words of this sentence " * 12
    cases = [
        h.case("just text here", [], 12),
        h.case("describe this picture in detail", [make_image(64, 48, 1)], 12),
        h.case(long_prompt, [], 24),
    ]
    late = h.case("hello there, who are you?", [make_image(80, 80, 6)], 12)
    lengths = [int(c.inputs.fill_ids.shape[0]) for c in cases]
    assert lengths[2] < 256 < lengths[2] + 24, lengths  # crosses a key bucket while decoding
    engine = h.engine()
    graphs = engine.runner.decode_graphs = DecodeGraphs(
        engine.model, engine.runner.kv_pool, engine.device, 8, 4096, capture=False
    )
    shapes = []
    shape_of = graphs.shape
    graphs.shape = lambda chunks: shapes.append(shape_of(chunks)) or shapes[-1]
    for i, case in enumerate(cases):
        engine.add_request(f"g{i}", SamplingParams(max_new_tokens=len(case.expected)), case.inputs)
    outputs: dict[str, list] = {}
    for _ in range(4):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    engine.add_request("late", SamplingParams(max_new_tokens=12), late.inputs)
    for rid, outs in run_to_completion(engine).items():
        outputs.setdefault(rid, []).extend(outs)
    for i, case in enumerate(cases):
        assert tokens_of(outputs[f"g{i}"]) == case.expected
    assert tokens_of(outputs["late"]) == late.expected
    assert {(4, 256), (4, 512)} <= set(shapes)  # a pad row; both key buckets
    assert graphs.num_steps >= 20
    assert engine.cache_manager.num_used == engine.cache_manager.cache.size_info().evictable_size
    engine.cache_manager.cache.check_integrity()


def test_a_step_past_the_key_budget_runs_eagerly(harness):
    """With room for 256 padded keys, two requests decoding together (2 rows x 256 keys) run
    eagerly, and their tokens are transformers'."""
    h = harness("qwen2_5_vl")
    image = make_image(64, 48, 2)
    cases = [h.case("just text here", [], 10), h.case("what is in it?", [image], 10)]
    engine = h.engine()
    graphs = engine.runner.decode_graphs = DecodeGraphs(
        engine.model, engine.runner.kv_pool, engine.device, 8, 256, capture=False
    )
    for i, case in enumerate(cases):
        engine.add_request(f"b{i}", SamplingParams(max_new_tokens=10), case.inputs)
    outputs = run_to_completion(engine)
    for i, case in enumerate(cases):
        assert tokens_of(outputs[f"b{i}"]) == case.expected
    assert graphs.num_steps == 0  # 2 rows x 256 keys > 256: every step eagerly
    assert graphs.shape([]) is None


def test_a_failed_static_step_fails_its_batch_and_the_engine_goes_on(harness):
    h = harness("qwen2_5_vl")
    first, second = h.case("just text here", [], 8), h.case("hello there, who are you?", [], 8)
    engine = h.engine(max_running_requests=1)
    graphs = engine.runner.decode_graphs = DecodeGraphs(
        engine.model, engine.runner.kv_pool, engine.device, 8, 4096, capture=False
    )
    graphs._forward = failing_on_call(graphs._forward, 2, RuntimeError("device lost"))
    engine.add_request("first", SamplingParams(max_new_tokens=8), first.inputs)
    engine.add_request("queued", SamplingParams(max_new_tokens=8), second.inputs)
    outputs = run_to_completion(engine)
    final = outputs["first"][-1]
    assert final.finish_reason == FinishReason.ERROR and "device lost" in final.error
    assert tokens_of(outputs["queued"]) == second.expected  # not in the failed batch
    assert engine.cache_manager.num_used == engine.cache_manager.cache.size_info().evictable_size


def test_without_cuda_the_capture_fails_and_steps_run_eagerly(harness, caplog):
    """Where a graph cannot be captured (here: no CUDA), graphs turn off, the log says so, and
    the step runs eagerly: the tokens are transformers'."""
    h = harness("qwen2_5_vl")
    case = h.case("just text here", [], 8)
    engine = h.engine(device="cpu")
    graphs = engine.runner.decode_graphs = DecodeGraphs(
        engine.model, engine.runner.kv_pool, engine.device, 8, 4096, capture=True
    )
    with caplog.at_level(logging.ERROR):
        engine.add_request("r", SamplingParams(max_new_tokens=8), case.inputs)
        assert tokens_of(run_to_completion(engine)["r"]) == case.expected
    assert not graphs.enabled and graphs.num_steps == 0
    assert "CUDA graphs are off, decode steps run eagerly" in caplog.text


def test_graph_settings_are_checked():
    for name in ("cuda_graph_max_batch", "cuda_graph_max_keys"):
        with pytest.raises(ValueError, match=name):
            LanguageConfig(**{name: 0})


def test_no_graphs_on_a_cpu(harness):
    assert harness("qwen2_5_vl").engine(device="cpu").runner.decode_graphs is None
