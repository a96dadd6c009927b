"""KV pool sizing from memory, the slot allocator, max_seq_len and bf16 compute on CPU."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
import torch

from services.language.config import LanguageConfig
from services.language.kvcache.pool import KVPool, SlotAllocator
from services.language.kvcache.sizing import (
    MIB,
    MemoryProbe,
    cpu_available_memory,
    plan_kv_pool,
    resolve_max_seq_len,
)
from tests.language.conftest import generate, make_image

GIB = 1 << 30


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def meminfo(tmp_path: Path, available_kib: int) -> Path:
    return write(
        tmp_path / "meminfo",
        f"MemTotal:       33554432 kB\nMemFree:  1000 kB\nMemAvailable:   {available_kib} kB\n",
    )


def test_cpu_memory_is_memavailable_without_a_cgroup_limit(tmp_path):
    probe = cpu_available_memory(meminfo(tmp_path, 8 * 1024 * 1024), tmp_path / "nocgroup")
    assert probe == MemoryProbe(8 * GIB, "MemAvailable")
    write(tmp_path / "v2/memory.max", "max\n")
    write(tmp_path / "v2/memory.current", "123\n")
    assert cpu_available_memory(meminfo(tmp_path, 1024), tmp_path / "v2").source == "MemAvailable"


def test_cpu_memory_is_capped_by_the_cgroup(tmp_path):
    write(tmp_path / "v2/memory.max", f"{4 * GIB}\n")
    write(tmp_path / "v2/memory.current", f"{GIB}\n")
    probe = cpu_available_memory(meminfo(tmp_path, 8 * 1024 * 1024), tmp_path / "v2")
    assert probe == MemoryProbe(3 * GIB, "cgroup limit minus usage")
    write(tmp_path / "v1/memory/memory.limit_in_bytes", f"{2 * GIB}\n")
    write(tmp_path / "v1/memory/memory.usage_in_bytes", f"{GIB // 2}\n")
    probe = cpu_available_memory(meminfo(tmp_path, 8 * 1024 * 1024), tmp_path / "v1")
    assert probe.available_bytes == GIB + GIB // 2
    write(tmp_path / "v1big/memory/memory.limit_in_bytes", "9223372036854771712\n")
    write(tmp_path / "v1big/memory/memory.usage_in_bytes", f"{GIB}\n")
    probe = cpu_available_memory(meminfo(tmp_path, 1024 * 1024), tmp_path / "v1big")
    assert probe == MemoryProbe(GIB, "MemAvailable")


def sizing(**kw):
    defaults = dict(
        num_kv_slots=0, kv_cache_memory_mb=0, kv_cache_memory_fraction=0.9, kv_cache_reserve_mb=1024
    )
    return types.SimpleNamespace(**{**defaults, **kw})


def test_plan_precedence_and_fraction_arithmetic():
    cpu = torch.device("cpu")
    probe = MemoryProbe(11 * GIB, "MemAvailable")
    plan = plan_kv_pool(sizing(), 4096, cpu, probe)
    assert plan.num_slots == int(0.9 * 10 * GIB) // 4096
    assert plan.reason == "0.9 x (11264 MiB MemAvailable - 1024 MiB reserve)"
    plan = plan_kv_pool(
        sizing(kv_cache_memory_fraction=0.5, kv_cache_reserve_mb=0), 1024, cpu, probe
    )
    assert plan.num_slots == 11 * GIB // 2 // 1024
    assert plan_kv_pool(sizing(kv_cache_memory_mb=64), 4096, cpu, probe).num_slots == 64 * 256
    plan = plan_kv_pool(sizing(kv_cache_memory_mb=64, num_kv_slots=100), 4096, cpu, probe)
    assert (plan.num_slots, plan.reason, plan.pool_bytes) == (100, "num_kv_slots", 409600)


def test_plan_without_memory_is_a_clear_error():
    probe = MemoryProbe(512 * MIB, "MemAvailable")
    with pytest.raises(ValueError, match="would hold no token.*kv_cache_reserve_mb"):
        plan_kv_pool(sizing(), 4096, torch.device("cpu"), probe)


def test_max_seq_len_resolution():
    assert resolve_max_seq_len(0, 10_000, 32_768) == 10_000
    assert resolve_max_seq_len(0, 100_000, 32_768) == 32_768
    assert resolve_max_seq_len(0, 5_000, 0) == 5_000
    assert resolve_max_seq_len(4_608, 100_000, 32_768) == 4_608
    assert resolve_max_seq_len(50_000, 10_000, 32_768) == 10_000  # clamped to the pool


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(kv_cache_memory_fraction=0.0), "kv_cache_memory_fraction must be in \\(0, 1\\]"),
        (dict(kv_cache_memory_fraction=1.5), "kv_cache_memory_fraction"),
        (dict(kv_cache_reserve_mb=-1), "kv_cache_reserve_mb must be >= 0"),
        (dict(max_seq_len=-5), "max_seq_len must be >= 0"),
        (dict(device="gpu"), "device must be"),
        (dict(dtype="int8"), "dtype must be one of"),
        (dict(chunk_size=0), "chunk_size must be >= 1"),
    ],
)
def test_config_refuses_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LanguageConfig(**kwargs)


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_large_cpu_pool_costs_nothing_until_used():
    before = rss_bytes()
    pool = KVPool(4, 256 * 1024, 2, 128, torch.float32, torch.device("cpu"))  # 2 GiB
    allocator = SlotAllocator(pool.num_slots)
    grown = rss_bytes() - before
    assert grown < 64 * MIB, f"an untouched 2 GiB pool committed {grown / MIB:.0f} MiB"
    slots = allocator.alloc(1000)
    k, v = pool.layer(0)
    k[slots] = 1.0
    v[slots] = 1.0
    assert rss_bytes() - before < 96 * MIB


def test_allocator_hands_out_fresh_slots_in_order_and_reuses_freed_ones_first():
    allocator = SlotAllocator(10)
    assert allocator.alloc(3).tolist() == [0, 1, 2]
    assert allocator.alloc(2).tolist() == [3, 4]
    allocator.free(torch.tensor([1, 3]))
    assert allocator.num_free == 7
    # the last freed first, in the order they were freed (a run comes back a run), then fresh
    assert allocator.alloc(3).tolist() == [1, 3, 5]
    allocator.free(torch.tensor([1, 3, 5]))
    assert allocator.alloc(2).tolist() == [3, 5]
    assert allocator.alloc(1).tolist() == [1]
    with pytest.raises(RuntimeError, match="double free"):
        allocator.free(torch.tensor([6]))  # never handed out
    with pytest.raises(RuntimeError, match="double free"):
        allocator.free(torch.tensor([0, 0]))
    assert allocator.alloc(5) is None and allocator.num_free == 4
    assert allocator.alloc(4).tolist() == [6, 7, 8, 9]
    assert allocator.num_free == 0


def test_engine_sizes_its_pool_from_memory_and_advertises_max_seq_len(harness):
    h = harness("qwen2_5_vl")
    engine = h.engine(num_kv_slots=0, kv_cache_memory_fraction=0.01, kv_cache_reserve_mb=0)
    plan = engine.kv_plan
    assert plan.reason.startswith("0.01 x (") and plan.num_slots > 1000
    assert engine.cache_manager.allocator.num_slots == plan.num_slots
    assert engine.max_seq_len == min(plan.num_slots, 32_768)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_bf16_compute_on_cpu_end_to_end(harness, arch, monkeypatch):
    """A bf16 engine (weights, KV pool, activations) against fp32: first-token logits within
    a few percent, and generation runs through with bf16 rows from the wire."""
    import services.language.engine.engine as engine_module

    h = harness(arch)
    case = h.case("describe this picture", [make_image(64, 48, 1)], 12)
    captured = []
    real_sample = engine_module.sample

    def recording(logits, states, constraints=None, kernels=None):
        captured.append(logits.clone())
        return real_sample(logits, states, constraints, kernels)

    monkeypatch.setattr(engine_module, "sample", recording)
    first_logits = {}
    for dtype in ("float32", "bfloat16"):
        engine = h.engine(dtype=dtype)
        captured.clear()
        # log-probabilities asked for: greedy steps then sample from the logits (without, a
        # bf16 engine on the native LM head takes each row's maximum from the head itself)
        tokens, final = generate(engine, case.inputs, 12, logprobs=True)
        first_logits[dtype] = captured[0][0]
        assert len(tokens) == 12 and all(0 <= t < engine.model_config.vocab_size for t in tokens)
    assert engine.runner.kv_pool.layer(0)[0].dtype == torch.bfloat16
    assert engine.runner.dtype == torch.bfloat16
    ref, got = first_logits["float32"], first_logits["bfloat16"]
    assert float((got - ref).norm() / ref.norm()) < 0.06
    assert int(got.argmax()) == int(ref.argmax()) == case.expected[0]
