"""No busy waiting: the control loops sleep until a frame, a call or a due timer.

``num_wakeups`` counts loop iterations. An endpoint with no rooms does not wake at all; one
whose room waits for a slow encoder wakes for heartbeats only; a timer set by an API call on a
sleeping loop still fires on time (the call wakes the loop to re-plan).
"""

from __future__ import annotations

import time

from common.transfer.types import FailureKind, TransferError

from .conftest import new_room, wait_for
from .forge import Forger
from .helpers import collect


def _wakeups(stats: dict) -> int:
    return stats["num_wakeups"]


def test_idle_endpoints_do_not_wake(sender, make_receiver) -> None:
    receiver = make_receiver()
    assert sender.ask("wait_idle", 10.0)["rooms_active"] == {}
    time.sleep(0.2)  # let any wake-up from earlier tests' traffic settle
    before = (_wakeups(receiver.stats()), _wakeups(sender.ask("call", "stats")))
    time.sleep(1.0)  # a 20 ms tick would have woken each loop 50 times
    after = (_wakeups(receiver.stats()), _wakeups(sender.ask("call", "stats")))
    assert after == before


def test_a_waiting_room_wakes_only_for_heartbeats(sender, make_receiver) -> None:
    receiver = make_receiver(heartbeat_interval_s=0.2)
    room, deadline = new_room(), time.monotonic() + 60.0
    sender.ask("call", "expect", room, deadline)
    receiver.add_room(room, sender.endpoint, deadline)
    assert wait_for(lambda: receiver.stats()["messages"].get("acknowledged_inits", 0) == 1)
    before, start = _wakeups(receiver.stats()), time.monotonic()
    time.sleep(2.0)
    woken, elapsed = _wakeups(receiver.stats()) - before, time.monotonic() - start
    beats = elapsed / 0.2  # ours out and the sender's in, each at most once per interval
    assert 0 < woken <= 2 * beats + 4, woken
    sender.ask("call", "fail", room, "test over")
    assert isinstance(collect(receiver, {room})[room], TransferError)


def test_a_timer_set_on_a_sleeping_loop_fires(make_receiver) -> None:
    receiver = make_receiver()
    silent = Forger()  # a peer that takes the init and never answers
    try:
        time.sleep(0.2)
        assert receiver.stats()["rooms_active"] == {}
        room, start = new_room(), time.monotonic()
        receiver.add_room(room, silent.endpoint, deadline=start + 0.5)
        got = collect(receiver, {room}, timeout_s=5.0)[room]
        assert isinstance(got, TransferError) and got.kind == FailureKind.DEADLINE
        assert time.monotonic() - start < 2.0  # not left to the next unrelated event
        bodies = [e.WhichOneof("body") for e in silent.replies()]
        assert bodies[0] == "init" and bodies[-1] == "abort"  # heartbeats in between
    finally:
        silent.close()


def test_adding_a_room_moves_the_sleeping_loops_alarm_without_waking_it(make_receiver) -> None:
    """The init goes out from the caller's thread; the loop, asleep with nothing due, is not
    woken to re-plan (a thread switch on the path of every small room): its alarm is moved
    to the room's first due time (here the first heartbeat, seconds away) instead."""
    receiver = make_receiver(heartbeat_interval_s=5.0, heartbeat_timeout_s=20.0)
    silent = Forger()  # takes the init and never answers
    try:
        time.sleep(0.2)
        assert receiver.stats()["rooms_active"] == {}
        before = _wakeups(receiver.stats())
        room = new_room()
        receiver.add_room(room, silent.endpoint, deadline=time.monotonic() + 60.0)
        assert wait_for(lambda: [e.WhichOneof("body") for e in silent.replies(0.1)] == ["init"])
        time.sleep(0.3)
        assert _wakeups(receiver.stats()) == before
        receiver.abort(room)
    finally:
        silent.close()
