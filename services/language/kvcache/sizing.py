"""How many KV token slots the pool gets, and how much memory is there to give.

First match wins (``LanguageConfig``): ``num_kv_slots`` > 0; ``kv_cache_memory_mb`` > 0; else
``kv_cache_memory_fraction`` of the memory left once the weights are loaded, less
``kv_cache_reserve_mb`` for activations and the rest of the process:

* CUDA: the free memory of the device (``torch.cuda.mem_get_info``), measured after loading.
* CPU: ``MemAvailable`` of ``/proc/meminfo``, capped by the process's cgroup limit minus its usage
  when it has one (cgroup v2 ``memory.max``/``memory.current``, or v1
  ``memory.limit_in_bytes``/``memory.usage_in_bytes``).

NOTE: on CPU the measurement is of the whole host (or cgroup): several workers started side by
side on one host each see the same free memory; give each a ``kv_cache_memory_fraction`` share
or a ``kv_cache_memory_mb``. The CPU pool's pages are committed only as slots are first written
(``kvcache/pool.py``), so a large pool costs nothing until it is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

MIB = 1 << 20
_NO_CGROUP_LIMIT = 1 << 60  # cgroup v1 reports "no limit" as a huge number


@dataclass(frozen=True)
class MemoryProbe:
    """Bytes available for the KV pool before the reserve, and where the figure comes from."""

    available_bytes: int
    source: str


@dataclass(frozen=True)
class KVPoolPlan:
    num_slots: int
    slot_bytes: int  # K and V of one token in every layer
    reason: str  # how the size was chosen, for the start-up line

    @property
    def pool_bytes(self) -> int:
        return self.num_slots * self.slot_bytes


def _meminfo_available(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no MemAvailable in {path}")


def _read_int(path: Path) -> int | None:
    try:
        raw = path.read_text().strip()
    except OSError:
        return None
    return None if raw in ("", "max") else int(raw)


def _cgroup_left(root: Path) -> int | None:
    """Limit minus usage of this process's memory cgroup, or None without a limit."""
    for limit_name, usage_name in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        limit = _read_int(root / limit_name)
        usage = _read_int(root / usage_name)
        if limit is not None and usage is not None and limit < _NO_CGROUP_LIMIT:
            return max(0, limit - usage)
    return None


def cpu_available_memory(
    meminfo: Path = Path("/proc/meminfo"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> MemoryProbe:
    available = _meminfo_available(meminfo)
    left = _cgroup_left(cgroup_root)
    if left is not None and left < available:
        return MemoryProbe(left, "cgroup limit minus usage")
    return MemoryProbe(available, "MemAvailable")


def available_memory(device: torch.device) -> MemoryProbe:
    """What the device has free now (call it after the weights are loaded)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return MemoryProbe(int(free), f"free memory of {device}")
    return cpu_available_memory()


def plan_kv_pool(
    config, slot_bytes: int, device: torch.device, probe: MemoryProbe | None = None
) -> KVPoolPlan:
    """The pool's size from ``config`` (a ``LanguageConfig``); ValueError when it would be empty.

    ``probe`` defaults to measuring ``device`` now.
    """
    if config.num_kv_slots > 0:
        return KVPoolPlan(config.num_kv_slots, slot_bytes, "num_kv_slots")
    if config.kv_cache_memory_mb > 0:
        num_slots = config.kv_cache_memory_mb * MIB // slot_bytes
        reason = f"kv_cache_memory_mb {config.kv_cache_memory_mb}"
    else:
        probe = probe or available_memory(device)
        reserve = config.kv_cache_reserve_mb * MIB
        budget = int(config.kv_cache_memory_fraction * max(0, probe.available_bytes - reserve))
        num_slots = budget // slot_bytes
        reason = (
            f"{config.kv_cache_memory_fraction:g} x ({probe.available_bytes // MIB} MiB "
            f"{probe.source} - {config.kv_cache_reserve_mb} MiB reserve)"
        )
    if num_slots < 1:
        raise ValueError(
            f"the KV pool would hold no token ({reason}, {slot_bytes} bytes per token): "
            "lower kv_cache_reserve_mb or set kv_cache_memory_mb / num_kv_slots"
        )
    return KVPoolPlan(num_slots, slot_bytes, reason)


def resolve_max_seq_len(requested: int, num_slots: int, max_position_embeddings: int) -> int:
    """The longest prompt + completion a request may have: ``requested`` (0 = the model's
    ``max_position_embeddings``, or the pool's capacity when unknown), never above the pool."""
    if requested > 0:
        return min(requested, num_slots)
    return min(num_slots, max_position_embeddings or num_slots)
