"""Fixed-size block allocator for the transfer buffers.

Invariants (checked, never silently violated):
- every block id is either free or owned by exactly one live ``Allocation``;
- ``free`` of an allocation that is not live (double free, or ids this allocator never handed
  out together) raises ``AllocatorError`` and changes nothing;
- ``num_free_blocks + num_used_blocks == num_blocks`` at all times.

Blocks are handed out lowest id first, so a fresh allocator gives contiguous runs and a
fragmented one gives whatever is free (callers must not assume contiguity).
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass


class AllocatorError(RuntimeError):
    """Double free, foreign block ids, or an invalid request."""


@dataclass(frozen=True)
class Allocation:
    """Blocks owned by one user; tokens live at slots 0.. of the blocks in this order."""

    block_ids: tuple[int, ...]
    num_tokens: int

    def capacity(self, block_size: int) -> int:
        return len(self.block_ids) * block_size


class BlockAllocator:
    """Thread-safe allocator of ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise AllocatorError(f"invalid allocator geometry {num_blocks}x{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._lock = threading.Lock()
        self._free: list[int] = list(range(num_blocks))  # a min-heap
        self._owner: dict[int, Allocation] = {}
        self._peak_used = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def alloc(self, num_tokens: int) -> Allocation | None:
        """Blocks for ``num_tokens`` tokens, or None when not enough are free."""
        if num_tokens <= 0:
            raise AllocatorError(f"num_tokens must be positive, got {num_tokens}")
        with self._lock:
            return self._take(self.blocks_for(num_tokens), num_tokens)

    def alloc_up_to(self, num_tokens: int) -> Allocation | None:
        """As many blocks as are free (at least one, at most enough for ``num_tokens``)."""
        if num_tokens <= 0:
            raise AllocatorError(f"num_tokens must be positive, got {num_tokens}")
        with self._lock:
            num = min(self.blocks_for(num_tokens), len(self._free))
            if num == 0:
                return None
            return self._take(num, min(num_tokens, num * self.block_size))

    def _take(self, num: int, num_tokens: int) -> Allocation | None:
        if num > len(self._free):
            return None
        ids = tuple(heapq.heappop(self._free) for _ in range(num))
        allocation = Allocation(ids, num_tokens)
        for block_id in ids:
            self._owner[block_id] = allocation
        self._peak_used = max(self._peak_used, self.num_blocks - len(self._free))
        return allocation

    def free(self, allocation: Allocation) -> None:
        with self._lock:
            self._check_live(allocation)
            self._release(allocation.block_ids)

    def shrink(self, allocation: Allocation, num_tokens: int) -> Allocation:
        """Keep the leading blocks ``num_tokens`` need and free the rest; the returned
        allocation replaces ``allocation``, which is no longer live."""
        num = self.blocks_for(num_tokens)
        if not 0 < num_tokens <= allocation.capacity(self.block_size):
            raise AllocatorError(f"cannot shrink {allocation} to {num_tokens} tokens")
        with self._lock:
            self._check_live(allocation)
            kept = Allocation(allocation.block_ids[:num], num_tokens)
            for block_id in kept.block_ids:
                self._owner[block_id] = kept
            self._release(allocation.block_ids[num:])
            return kept

    def extend(self, allocation: Allocation, num_tokens: int) -> Allocation | None:
        """``allocation``'s blocks followed by new ones, for ``num_tokens`` tokens in all; None
        (and ``allocation`` untouched) when not enough are free. The returned allocation
        replaces ``allocation``, which is no longer live."""
        if num_tokens < allocation.num_tokens:
            raise AllocatorError(f"cannot extend {allocation} to fewer tokens ({num_tokens})")
        with self._lock:
            self._check_live(allocation)
            num_new = self.blocks_for(num_tokens) - len(allocation.block_ids)
            if num_new > len(self._free):
                return None
            new_ids = tuple(heapq.heappop(self._free) for _ in range(max(0, num_new)))
            grown = Allocation(allocation.block_ids + new_ids, num_tokens)
            for block_id in grown.block_ids:
                self._owner[block_id] = grown
            self._peak_used = max(self._peak_used, self.num_blocks - len(self._free))
            return grown

    def _check_live(self, allocation: Allocation) -> None:
        for block_id in allocation.block_ids:
            if self._owner.get(block_id) != allocation:
                raise AllocatorError(
                    f"block {block_id} is not owned by this allocation (double free or foreign id)"
                )

    def _release(self, block_ids: tuple[int, ...]) -> None:
        for block_id in block_ids:
            del self._owner[block_id]
            heapq.heappush(self._free, block_id)

    @property
    def num_free_blocks(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        with self._lock:
            return self.num_blocks - len(self._free)

    @property
    def peak_used_blocks(self) -> int:
        with self._lock:
            return self._peak_used
