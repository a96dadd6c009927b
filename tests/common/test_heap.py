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
    early = Node()
    early_ref = weakref.ref(early)
    num_frozen = freeze_startup_heap()
    assert num_frozen >= 1 and gc.get_freeze_count() > 0
    del early  # garbage now, but frozen: the collector never looks at it
    gc.collect()
    assert early_ref() is not None
    later = weakref.ref(Node())
    gc.collect()
    assert later() is None  # a cycle made after the freeze is still found and freed
