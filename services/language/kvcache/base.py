"""The prefix-cache contract the scheduler relies on.

A prefix cache maps token-key sequences to the KV slots that hold their K/V. A key is an array
of ``kvcache/key.py`` records, ``(fill_id, image_key)`` per token: text tokens carry their id and
0, image tokens their image's pad id and 64 bits of its content hash, so a prefix through an
image is shared only with the same image. Invariants every implementation keeps:

* Every slot it holds is owned by it alone: the caller never frees a slot it gave the cache,
  and the cache returns slots to the caller only from ``evict``.
* A node returned by ``match_prefix``/``insert`` stays valid and its slots unevicted while it is
  locked; ``lock(node)`` protects the whole path root -> node (lock_ref counts per node).
* ``evict`` only removes unlocked leaves, least recently used first.
* ``evictable_size + protected_size`` equals the number of slots held.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import numpy as np
import torch


class MatchResult(NamedTuple):
    num_matched: int  # leading tokens of the key found in the cache
    slots: torch.Tensor  # long [num_matched]: their KV slots (owned by the cache)
    node: Any  # handle to lock; its path covers exactly the matched tokens


class InsertResult(NamedTuple):
    num_prefix: int  # leading tokens that were already cached (caller frees its copies)
    node: Any  # handle of the node that ends at the inserted key


class SizeInfo(NamedTuple):
    evictable_size: int  # slots in unlocked nodes
    protected_size: int  # slots in locked nodes


class BasePrefixCache(ABC):
    @abstractmethod
    def match_prefix(self, key: np.ndarray) -> MatchResult:
        """Longest cached prefix of ``key``; splits a node so the result ends on a boundary."""

    @abstractmethod
    def insert(self, key: np.ndarray, slots: torch.Tensor) -> InsertResult:
        """Cache ``key`` -> ``slots``. Slots of the already-cached prefix stay the cache's;
        the caller keeps ownership of ``slots[:num_prefix]`` and must free them."""

    @abstractmethod
    def lock(self, node: Any) -> None:
        """Protect root -> node from eviction (one lock_ref more on each node of the path)."""

    @abstractmethod
    def unlock(self, node: Any) -> None:
        """Undo one ``lock(node)``."""

    @abstractmethod
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Remove LRU unlocked leaves until >= ``num_tokens`` slots are freed (or none are left);
        returns the freed slots, now owned by the caller."""

    @abstractmethod
    def size_info(self) -> SizeInfo: ...

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError when an invariant above does not hold."""
