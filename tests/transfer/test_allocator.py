from __future__ import annotations

import threading

import pytest

from common.transfer.allocator import Allocation, AllocatorError, BlockAllocator


def test_alloc_rounds_up_and_counts() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=128)
    a = alloc.alloc(129)
    assert a == Allocation((0, 1), 129)
    assert a.capacity(128) == 256
    assert (alloc.num_free_blocks, alloc.num_used_blocks, alloc.peak_used_blocks) == (6, 2, 2)
    alloc.free(a)
    assert (alloc.num_free_blocks, alloc.num_used_blocks, alloc.peak_used_blocks) == (8, 0, 2)


def test_alloc_none_when_short_and_nothing_taken() -> None:
    alloc = BlockAllocator(4, 128)
    assert alloc.alloc(3 * 128) is not None
    assert alloc.alloc(2 * 128) is None
    assert alloc.num_free_blocks == 1


def test_alloc_up_to_takes_what_is_free() -> None:
    alloc = BlockAllocator(4, 128)
    held = alloc.alloc(3 * 128)
    partial = alloc.alloc_up_to(1000)
    assert partial == Allocation((3,), 128)
    assert alloc.alloc_up_to(1) is None
    alloc.free(held)
    assert alloc.alloc_up_to(100) == Allocation((0,), 100)


def test_lowest_ids_first_gives_non_contiguous_after_fragmentation() -> None:
    alloc = BlockAllocator(6, 128)
    singles = [alloc.alloc(1) for _ in range(6)]
    for a in singles[::2]:
        alloc.free(a)
    assert alloc.alloc(3 * 128).block_ids == (0, 2, 4)


def test_double_free_and_foreign_ids_raise_without_side_effects() -> None:
    alloc = BlockAllocator(4, 128)
    a = alloc.alloc(256)
    alloc.free(a)
    with pytest.raises(AllocatorError):
        alloc.free(a)
    b = alloc.alloc(128)
    with pytest.raises(AllocatorError):
        alloc.free(Allocation((b.block_ids[0], 3), 256))  # one owned id, one free id
    assert alloc.num_used_blocks == 1
    with pytest.raises(AllocatorError):
        alloc.free(Allocation((99,), 1))
    with pytest.raises(AllocatorError):
        alloc.alloc(0)


def test_shrink_keeps_leading_blocks_and_frees_the_rest() -> None:
    alloc = BlockAllocator(8, 4)
    whole = alloc.alloc(16)  # blocks 0..3
    kept = alloc.shrink(whole, 5)
    assert kept == Allocation((0, 1), 5)
    assert alloc.num_used_blocks == 2
    with pytest.raises(AllocatorError):
        alloc.free(whole)  # replaced by `kept`
    with pytest.raises(AllocatorError):
        alloc.shrink(kept, 9)  # more than it holds
    assert alloc.alloc(8).block_ids == (2, 3)
    alloc.free(kept)
    assert alloc.num_used_blocks == 2


def test_concurrent_alloc_free_keeps_invariants() -> None:
    alloc = BlockAllocator(64, 128)
    errors: list[Exception] = []

    def worker() -> None:
        try:
            for i in range(500):
                a = alloc.alloc(1 + (i % 5) * 128)
                if a is not None:
                    assert len(set(a.block_ids)) == len(a.block_ids)
                    alloc.free(a)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert alloc.num_free_blocks == 64 and alloc.num_used_blocks == 0
    assert alloc.peak_used_blocks <= 64
