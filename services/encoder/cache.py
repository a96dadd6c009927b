"""Embedding cache: image key -> its rows, LRU, bounded in bytes.

Invariants: ``num_bytes`` is the sum of the stored tensors' sizes and never exceeds
``capacity_bytes`` after a ``put``; an entry larger than the capacity is not stored; a ``get``
hit makes the entry most recently used. Stored tensors are never modified (callers copy out).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheStats:
    num_entries: int
    num_bytes: int
    capacity_bytes: int
    num_hits: int
    num_misses: int
    num_evictions: int


class EmbeddingCache:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self._num_bytes = 0
        self._num_hits = self._num_misses = self._num_evictions = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        """The rows stored under ``key`` (counted as a hit or a miss)."""
        with self._lock:
            rows = self._entries.get(key)
            if rows is None:
                self._num_misses += 1
                return None
            self._entries.move_to_end(key)
            self._num_hits += 1
            return rows

    def peek(self, key: bytes) -> torch.Tensor | None:
        """Like ``get`` but counts nothing and leaves the LRU order alone."""
        with self._lock:
            return self._entries.get(key)

    def __contains__(self, key: bytes) -> bool:
        """Presence test that counts nothing and does not touch the LRU order."""
        with self._lock:
            return key in self._entries

    def put(self, key: bytes, rows: torch.Tensor) -> bool:
        """Store ``rows``; evict least recently used entries to fit. False if it cannot fit."""
        size = rows.numel() * rows.element_size()
        if size > self.capacity_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._num_bytes -= old.numel() * old.element_size()
            while self._num_bytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._num_bytes -= evicted.numel() * evicted.element_size()
                self._num_evictions += 1
            self._entries[key] = rows
            self._num_bytes += size
            return True

    def keys(self) -> list[bytes]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                len(self._entries),
                self._num_bytes,
                self.capacity_bytes,
                self._num_hits,
                self._num_misses,
                self._num_evictions,
            )
