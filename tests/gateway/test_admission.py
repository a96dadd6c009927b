"""The admission table: bounded, keyed by the client's id, aborts only by the same owner."""

from __future__ import annotations

import pytest

from services.gateway.admission import Admission, DuplicateRequest, QueueFull


def test_live_duplicate_is_refused_and_the_first_is_untouched() -> None:
    admission = Admission(max_queued=4)
    cancelled: list[str] = []
    first = admission.admit("req-1", owner="peer:a")
    first.on_cancel(lambda: cancelled.append("first"))
    with pytest.raises(DuplicateRequest, match="'req-1' is already in flight"):
        admission.admit("req-1", owner="peer:a")
    with pytest.raises(DuplicateRequest):
        admission.admit("req-1", owner="peer:b")
    assert admission.num_in_flight == 1 and not first.cancelled and cancelled == []
    admission.finish(first)
    again = admission.admit("req-1", owner="peer:b")  # the id is free once finished
    assert again is not first and admission.num_in_flight == 1


def test_finish_of_a_stale_entry_leaves_the_live_one() -> None:
    admission = Admission(max_queued=4)
    first = admission.admit("req-1")
    admission.finish(first)
    second = admission.admit("req-1")
    admission.finish(first)  # a late second finish of the old request
    assert admission.num_in_flight == 1
    assert admission.abort("req-1") and second.cancelled


def test_abort_reaches_only_the_owner() -> None:
    admission = Admission(max_queued=4)
    cancelled: list[str] = []
    mine = admission.admit("job", owner="key:abc")
    mine.on_cancel(lambda: cancelled.append("job"))
    assert admission.abort("job", owner="key:other") is False
    assert admission.abort("job", owner="peer:ipv4:127.0.0.1:5000") is False
    assert not mine.cancelled and cancelled == []
    assert admission.abort("unknown", owner="key:abc") is False
    assert admission.abort("job", owner="key:abc") is True
    assert mine.cancelled and cancelled == ["job"]
    late: list[str] = []
    mine.on_cancel(lambda: late.append("late"))  # registered after the abort: runs at once
    assert late == ["late"]


def test_queue_bound_and_generated_ids() -> None:
    admission = Admission(max_queued=2)
    a, b = admission.admit(), admission.admit()
    assert a.request_id != b.request_id and len(a.request_id) == 32
    with pytest.raises(QueueFull, match="2 requests in flight"):
        admission.admit()
    admission.finish(a)
    admission.admit()
