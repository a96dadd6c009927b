"""Radix tree over token-key sequences whose nodes hold KV slot indices.

Keys are ``kvcache/key.py`` records, ``(fill_id, image_key)`` per token, so image tokens match
only the same image (pad id and 64-bit content hash). Each edge (node) stores a run of records
and the slots of those tokens; children are indexed by the label of their run's first record.
Locks are counted per node along the path (``lock_ref``), so a node is protected exactly when
some locked handle lies at or below it. Eviction removes unlocked leaves in least-recently-used
order (access time = a counter bumped on match and insert).
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from services.language.kvcache.base import BasePrefixCache, InsertResult, MatchResult, SizeInfo
from services.language.kvcache.key import KEY_DTYPE, check_key, common_prefix_len, edge_label


class RadixNode:
    __slots__ = ("key", "slots", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: np.ndarray, slots: torch.Tensor, parent: RadixNode | None) -> None:
        self.key = key  # KEY_DTYPE [n]
        self.slots = slots  # long [n]
        self.children: dict[tuple[int, int], RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0

    def __len__(self) -> int:
        return int(self.key.shape[0])

    def __lt__(self, other: RadixNode) -> bool:  # heap order: LRU first
        return self.last_access < other.last_access


class RadixCache(BasePrefixCache):
    def __init__(self) -> None:
        self.root = RadixNode(np.zeros(0, KEY_DTYPE), torch.zeros(0, dtype=torch.long), None)
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = 0
        self._evictable = 0
        self._protected = 0

    def _touch(self, node: RadixNode) -> None:
        self._clock += 1
        node.last_access = self._clock

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut ``node`` after ``at`` keys; returns the new upper half (same lock_ref)."""
        upper = RadixNode(node.key[:at], node.slots[:at], node.parent)
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        node.parent.children[edge_label(node.key[0])] = upper
        node.key, node.slots, node.parent = node.key[at:], node.slots[at:], upper
        upper.children[edge_label(node.key[0])] = node
        return upper

    def _walk(self, key: np.ndarray) -> tuple[RadixNode, int, list[torch.Tensor]]:
        node, pos, parts = self.root, 0, []
        self._touch(node)
        while pos < key.shape[0] and edge_label(key[pos]) in node.children:
            child = node.children[edge_label(key[pos])]
            n = common_prefix_len(child.key, key[pos:])
            if n < len(child):
                child = self._split(child, n)
            node, pos = child, pos + n
            parts.append(child.slots)
            self._touch(node)
        return node, pos, parts

    def match_prefix(self, key: np.ndarray) -> MatchResult:
        node, pos, parts = self._walk(check_key(key))
        slots = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
        return MatchResult(pos, slots, node)

    def insert(self, key: np.ndarray, slots: torch.Tensor) -> InsertResult:
        if check_key(key).shape[0] != slots.shape[0]:
            raise ValueError("key and slots differ in length")
        node, pos, _ = self._walk(key)
        if pos < key.shape[0]:
            leaf = RadixNode(key[pos:].copy(), slots[pos:].clone(), node)
            node.children[edge_label(key[pos])] = leaf
            self._touch(leaf)
            self._evictable += len(leaf)
            node = leaf
        return InsertResult(pos, node)

    def lock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node)
                self._protected += len(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of an unlocked radix node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node)
                self._protected -= len(node)
            node = node.parent

    def evict(self, num_tokens: int) -> torch.Tensor:
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while leaves and num_freed < num_tokens:
            leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[edge_label(leaf.key[0])]
            freed.append(leaf.slots)
            num_freed += len(leaf)
            self._evictable -= len(leaf)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return torch.cat(freed) if freed else torch.zeros(0, dtype=torch.long)

    def size_info(self) -> SizeInfo:
        return SizeInfo(self._evictable, self._protected)

    def _nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check_integrity(self) -> None:
        evictable = protected = 0
        seen: list[torch.Tensor] = []
        for node in self._nodes():
            assert len(node) > 0 and node.slots.shape[0] == len(node), "empty or ragged node"
            assert node.key.dtype == KEY_DTYPE, "key records of the wrong type"
            assert node.parent.children.get(edge_label(node.key[0])) is node, "child index broken"
            assert node.lock_ref >= 0, "negative lock_ref"
            child_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_locks, "lock_ref below the sum of its children's"
            if node.lock_ref:
                protected += len(node)
            else:
                evictable += len(node)
            seen.append(node.slots)
        assert (evictable, protected) == (self._evictable, self._protected), "size counters off"
        if seen:
            all_slots = torch.cat(seen)
            assert all_slots.unique().numel() == all_slots.numel(), "a slot held twice"
