"""The start-up heap is frozen out of the cyclic collector, and later objects still collect."""

import gc
import weakref

import pytest

from common.heap import freeze_startup_heap


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # later tests see the collector as they would


class Node:
    def __init__(self) -> None:
        self.other = self  # a cycle: only the cyclic collector frees it


def test_startup_objects_frozen_later_cycles_still_collected(unfrozen):
    startup = [Node() for _ in range(1000)]
    num_frozen = freeze_startup_heap()
    assert num_frozen >= len(startup) and gc.get_freeze_count() == num_frozen
    gc.collect()
    assert gc.get_freeze_count() == num_frozen  # a full collection leaves them frozen
    later = weakref.ref(Node())
    gc.collect()
    assert later() is None  # a cycle made after the freeze is still found and freed
