"""Scenario tests of the radix cache: exact matches, splits, lock refs and eviction order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.language.kvcache.key import make_key
from services.language.kvcache.radix_cache import RadixCache

VOCAB = 400


def key(*ids: int) -> np.ndarray:
    """A text key (image key 0 on every token)."""
    return make_key(ids)


def image_key(*tokens: tuple[int, int] | int) -> np.ndarray:
    """A key from ints (text) and ``(pad id, image key)`` pairs (image tokens)."""
    fill = [t[0] if isinstance(t, tuple) else t for t in tokens]
    image = [t[1] if isinstance(t, tuple) else 0 for t in tokens]
    return make_key(fill, image)


def slots(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def test_empty_cache_matches_nothing():
    cache = RadixCache()
    result = cache.match_prefix(key(1, 2, 3))
    assert result.num_matched == 0 and result.slots.numel() == 0
    assert cache.size_info() == (0, 0)
    cache.check_integrity()


def test_insert_then_exact_and_partial_matches():
    cache = RadixCache()
    assert cache.insert(key(1, 2, 3, 4), slots(10, 11, 12, 13)).num_prefix == 0
    full = cache.match_prefix(key(1, 2, 3, 4, 5))
    assert full.num_matched == 4 and full.slots.tolist() == [10, 11, 12, 13]
    part = cache.match_prefix(key(1, 2, 9))  # splits the node after two keys
    assert part.num_matched == 2 and part.slots.tolist() == [10, 11]
    assert len(part.node) == 2 and len(cache.root.children) == 1
    assert cache.match_prefix(key(7)).num_matched == 0
    assert cache.size_info() == (4, 0)
    cache.check_integrity()


def test_insert_reports_cached_prefix_and_branches():
    cache = RadixCache()
    cache.insert(key(1, 2, 3), slots(0, 1, 2))
    result = cache.insert(key(1, 2, 5, 6), slots(7, 8, 3, 4))
    assert result.num_prefix == 2  # caller frees its own slots 7, 8
    assert cache.match_prefix(key(1, 2, 5, 6)).slots.tolist() == [0, 1, 3, 4]
    assert cache.match_prefix(key(1, 2, 3)).slots.tolist() == [0, 1, 2]
    assert cache.size_info() == (5, 0)
    cache.check_integrity()


def test_image_pad_ids_keep_different_images_apart():
    image_a, image_b = (VOCAB + 11, 7), (VOCAB + 99, 8)
    cache = RadixCache()
    cache.insert(image_key(1, 2, image_a, image_a, 3), slots(0, 1, 2, 3, 4))
    assert cache.match_prefix(image_key(1, 2, image_b, image_b, 3)).num_matched == 2


def test_equal_pad_ids_of_different_images_do_not_match():
    """Two images whose pad ids collide (30 bits) are still told apart by their image key."""
    pad = VOCAB + 11
    cache = RadixCache()
    cache.insert(image_key(1, 2, (pad, 111), (pad, 111), 3), slots(0, 1, 2, 3, 4))
    other = cache.match_prefix(image_key(1, 2, (pad, 222), (pad, 222), 3))
    assert other.num_matched == 2 and other.slots.tolist() == [0, 1]
    same = cache.match_prefix(image_key(1, 2, (pad, 111), (pad, 111), 3))
    assert same.num_matched == 5
    # inserting the other image branches off after the shared text
    result = cache.insert(image_key(1, 2, (pad, 222), (pad, 222), 5), slots(9, 8, 5, 6, 7))
    assert result.num_prefix == 2
    assert cache.size_info() == (8, 0)
    cache.check_integrity()


def test_keys_must_be_records():
    cache = RadixCache()
    with pytest.raises(TypeError):
        cache.match_prefix(np.array([1, 2, 3]))
    with pytest.raises(TypeError):
        cache.insert(np.array([1, 2]), slots(0, 1))


def test_lock_refs_along_the_path():
    cache = RadixCache()
    cache.insert(key(1, 2, 3, 4), slots(0, 1, 2, 3))
    node = cache.match_prefix(key(1, 2)).node  # split: [1,2] -> [3,4]
    leaf = cache.match_prefix(key(1, 2, 3, 4)).node
    cache.lock(leaf)
    cache.lock(node)
    assert (node.lock_ref, leaf.lock_ref) == (2, 1)
    assert cache.size_info() == (0, 4)
    cache.check_integrity()
    assert cache.evict(10).numel() == 0  # everything is locked
    cache.unlock(leaf)
    assert cache.size_info() == (2, 2)
    assert cache.evict(10).tolist() == [2, 3]  # only the unlocked leaf goes
    cache.unlock(node)
    assert cache.size_info() == (2, 0)
    with pytest.raises(RuntimeError):
        cache.unlock(node)
    cache.check_integrity()


def test_eviction_is_lru_over_leaves_and_cascades_to_parents():
    cache = RadixCache()
    cache.insert(key(1, 2, 3), slots(0, 1, 2))  # A
    cache.insert(key(1, 2, 4), slots(0, 1, 3))  # B shares [1,2]; its own copies are the caller's
    cache.insert(key(5, 6), slots(4, 5))  # C
    cache.match_prefix(key(1, 2, 3))  # A used most recently, then C, then B oldest
    cache.match_prefix(key(5, 6))
    cache.match_prefix(key(1, 2, 3))
    assert cache.evict(1).tolist() == [3]  # B's leaf
    assert cache.evict(1).tolist() == [4, 5]  # C
    # A's leaf goes, then its parent [1,2] has become an unlocked leaf and follows.
    assert cache.evict(3).tolist() == [2, 0, 1]
    assert cache.size_info() == (0, 0)
    cache.check_integrity()


def test_check_integrity_detects_corruption():
    cache = RadixCache()
    cache.insert(key(1, 2), slots(0, 1))
    cache.insert(key(3, 4), slots(2, 3))
    cache.root.children[(3, 0)].slots = slots(0, 9)  # slot 0 now held twice
    with pytest.raises(AssertionError):
        cache.check_integrity()
    cache = RadixCache()
    cache.insert(key(1, 2), slots(0, 1))
    cache.root.children[(1, 0)].lock_ref = 1  # counters no longer agree
    with pytest.raises(AssertionError):
        cache.check_integrity()
