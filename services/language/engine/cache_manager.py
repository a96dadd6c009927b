"""Moves KV slots between the allocator, the radix cache and requests.

Every slot is at any time in exactly one of: the allocator's free list, the radix cache, or a
request's own range ``slots[num_tree:num_computed]`` (see ``request.py``). The cache manager is
the only code that moves them.
"""

from __future__ import annotations

import torch

from services.language.engine.request import Request
from services.language.kvcache.base import BasePrefixCache
from services.language.kvcache.pool import SlotAllocator


class CacheManager:
    def __init__(self, allocator: SlotAllocator, prefix_cache: BasePrefixCache) -> None:
        self.allocator = allocator
        self.cache = prefix_cache
        self.num_hit_tokens = 0  # prompt tokens served from the radix cache, lifetime
        self.num_evicted_tokens = 0  # tokens evicted from the radix cache, lifetime

    @property
    def num_available(self) -> int:
        """Slots obtainable now: free plus evictable."""
        return self.allocator.num_free + self.cache.size_info().evictable_size

    @property
    def num_used(self) -> int:
        return self.allocator.num_slots - self.allocator.num_free

    def allocate(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` fresh slots, evicting LRU radix leaves first; None if impossible."""
        shortfall = num_tokens - self.allocator.num_free
        if shortfall > 0:
            evicted = self.cache.evict(shortfall)
            self.num_evicted_tokens += len(evicted)
            self.allocator.free(evicted)
        return self.allocator.alloc(num_tokens)

    def admit(self, req: Request) -> None:
        """Match the radix cache and lock the hit. With the whole prompt at least one token is
        left to compute (its logits give the first token); of a prompt still arriving every
        token that arrived may come from the cache (nothing is sampled before the rest), so a
        long cached prompt delivered in chunks is matched as far as it arrived, not to its
        first chunk. A request that still gathers prompt log-probabilities matches nothing:
        it computes every prompt row itself."""
        key = req.radix_key()
        if req.wants_prompt_logprobs:
            num_key = 0
        else:
            num_key = len(key) - 1 if req.prompt_complete else len(key)
        match = self.cache.match_prefix(key[:num_key])
        self.cache.lock(match.node)
        req.tree_node, req.num_tree = match.node, match.num_matched
        req.slots, req.num_computed = match.slots.clone(), match.num_matched

    def count_hit(self, req: Request) -> None:
        """``req`` was admitted for the first time: its matched prefix is its cache hit."""
        req.num_cached_tokens = req.num_tree
        self.num_hit_tokens += req.num_tree

    def extend(self, req: Request, new_slots: torch.Tensor) -> None:
        req.slots = torch.cat([req.slots, new_slots])

    def cache_prefix(self, req: Request) -> None:
        """Hand the computed tokens to the radix cache (prefill done, or finishing).

        The cache keeps its own copies of any prefix it already had; our duplicates are freed
        and the request switches to the cache's slots (same K/V values), re-locking the path.
        """
        num = req.num_computed
        key = req.radix_key(num)
        result = self.cache.insert(key, req.slots[:num])
        self.allocator.free(req.slots[req.num_tree : result.num_prefix])
        match = self.cache.match_prefix(key)
        assert match.num_matched == num, "inserted key not found"
        self.cache.lock(match.node)
        self.cache.unlock(req.tree_node)
        req.slots = torch.cat([match.slots, req.slots[num:]])
        req.tree_node, req.num_tree = match.node, num

    def release(self, req: Request) -> None:
        """Free the request's own slots and its lock (abort, finish, preemption)."""
        if req.tree_node is not None:
            self.allocator.free(req.slots[req.num_tree :])
            self.cache.unlock(req.tree_node)
        req.tree_node, req.num_tree, req.num_computed = None, 0, 0
        req.slots = torch.zeros(0, dtype=torch.long)
