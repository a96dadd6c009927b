"""Timeouts measure liveness and the request's deadline, not how long the encoder works.

Real processes (the sender is spawned), real Mooncake over tcp, short timeouts: a room the
encoder announced (``expect``) waits for data that comes long after ``bootstrap_timeout_s``,
and for the init of a receiver that claimed it while short of blocks; an announced room that no
receiver asked for or claimed times out (its gateway died), and so does an unannounced one; a
killed sender is noticed through its missing heartbeats; a restarted one through its new
incarnation; the request's deadline ends a room on both sides. A receiver that could not listen
(its loop held past the heartbeat timeout, as a starved process is) does not count that time as
its sender's silence.
"""

from __future__ import annotations

import time

import pytest

from bench.peer import Peer
from bench.synthetic import make_request, matches
from common.transfer.types import FailureKind, ReceivedEmbeddings, RoomState, TransferError

from .conftest import assert_no_leaks, layout_of, make_config, new_room, wait_for
from .helpers import collect, sender_state, spec

SHORT = dict(
    bootstrap_timeout_s=1.0,
    waiting_timeout_s=1.0,
    transfer_timeout_s=1.0,
    heartbeat_interval_s=0.2,
    heartbeat_timeout_s=1.0,
)
ENCODE_S = 4 * SHORT["bootstrap_timeout_s"]  # how long the "encoder" works on a slow image


@pytest.fixture(scope="module")
def short_sender():
    config = make_config(num_blocks=64, **SHORT)
    peer = Peer("sender", config, layout_of(config))
    yield peer
    peer.close()


def _acks(receiver) -> int:
    return receiver.stats()["messages"].get("acknowledged_inits", 0)


@pytest.mark.parametrize("order", ["expect-init-data", "init-expect-data"])
def test_announced_room_waits_for_slow_data(short_sender, make_receiver, order: str) -> None:
    sender, receiver = short_sender, make_receiver(**SHORT)
    s = spec(new_room(), 1500)
    deadline = time.monotonic() + 60.0
    steps = {
        "expect": lambda: sender.ask("call", "expect", s.seed, deadline),
        "init": lambda: receiver.add_room(s.seed, sender.endpoint, deadline),
        "data": lambda: sender.ask("submit", s),
    }
    first, second, last = order.split("-")
    steps[first]()
    if first == "init":  # the init beats the encoder's expect(): held bootstrap_timeout_s
        assert wait_for(lambda: sender_state(sender, s.seed) == RoomState.WAITING_FOR_INPUT)
    steps[second]()
    # acknowledged again when expect() moves the bound to the deadline
    assert wait_for(lambda: _acks(receiver) == (2 if first == "init" else 1))
    time.sleep(ENCODE_S)  # the ViT takes its time; only heartbeats flow meanwhile
    assert sender_state(sender, s.seed) == RoomState.WAITING_FOR_INPUT
    assert receiver.poll(s.seed) == RoomState.WAITING_FOR_INPUT
    steps[last]()
    got = collect(receiver, {s.seed})[s.seed]
    assert isinstance(got, ReceivedEmbeddings), got
    assert matches(got, make_request(s, receiver.layout))
    receiver.release(s.seed)
    assert sender.ask("call", "stats")["failed_by_reason"] == {}
    assert_no_leaks(sender, receiver)


def _queued_for_blocks(sender, receiver, deadline: float):
    """An announced room whose data is ready while the receiver's buffer (8 blocks) is taken by
    a hog: the receiver queues it (and claims it). Returns its spec and the hog."""
    hog = receiver.allocator.alloc(8 * 128)
    s = spec(new_room(), 700)
    sender.ask("call", "expect", s.seed, deadline)
    assert sender.ask("submit", s)
    receiver.add_room(s.seed, sender.endpoint, deadline)
    return s, hog


def test_announced_room_no_receiver_asked_for_times_out(short_sender) -> None:
    """The gateway died after the encoder accepted the room and before any language worker
    heard of it: the data is freed after ``bootstrap_timeout_s``, not at the deadline."""
    sender = short_sender
    s = spec(new_room(), 700)
    sender.ask("call", "expect", s.seed, time.monotonic() + 60.0)
    assert sender.ask("submit", s)
    start = time.monotonic()
    assert wait_for(lambda: sender_state(sender, s.seed) == RoomState.FAILED, 5.0)
    assert time.monotonic() - start < 4 * SHORT["bootstrap_timeout_s"]
    stats = sender.ask("wait_idle", 5.0)
    assert stats["num_used_blocks"] == 0 and stats["failed_by_reason"]["bootstrap_timeout"] >= 1


def test_claimed_room_waits_for_the_receivers_blocks(short_sender, make_receiver) -> None:
    """A receiver short of blocks claims the room: the sender holds the data for it long past
    ``bootstrap_timeout_s`` (its heartbeats say it lives), and the init that comes once blocks
    are free is served."""
    sender, receiver = short_sender, make_receiver(**SHORT, num_blocks=8)
    failed_before = sender.ask("call", "stats")["failed_by_reason"]
    s, hog = _queued_for_blocks(sender, receiver, time.monotonic() + 60.0)
    time.sleep(ENCODE_S)
    assert receiver.poll(s.seed) == RoomState.BOOTSTRAPPING
    assert sender_state(sender, s.seed) == RoomState.BOOTSTRAPPING
    with receiver._lock:  # the blocks come free: the queued room gets them and its init goes
        receiver._free(hog)
    got = collect(receiver, {s.seed})[s.seed]
    assert isinstance(got, ReceivedEmbeddings), got
    assert matches(got, make_request(s, receiver.layout))
    receiver.release(s.seed)
    assert sender.ask("call", "stats")["failed_by_reason"] == failed_before
    assert_no_leaks(sender, receiver)


def test_aborting_a_claimed_room_frees_the_senders_data(short_sender, make_receiver) -> None:
    sender, receiver = short_sender, make_receiver(**SHORT, num_blocks=8)
    handled = sender.ask("call", "stats")["messages"].get("handled", 0)
    s, hog = _queued_for_blocks(sender, receiver, time.monotonic() + 60.0)
    assert wait_for(lambda: sender.ask("call", "stats")["messages"]["handled"] > handled)
    receiver.abort(s.seed)  # the request was cancelled before any init went out
    assert wait_for(lambda: sender_state(sender, s.seed) == RoomState.FAILED, 2.0)
    assert sender.ask("call", "stats")["failed_by_reason"].get("aborted", 0) >= 1
    with receiver._lock:
        receiver._free(hog)
    assert_no_leaks(sender, receiver)


def test_unannounced_init_still_times_out(short_sender, make_receiver) -> None:
    sender, receiver = short_sender, make_receiver(**SHORT)
    room = new_room()
    start = time.monotonic()
    receiver.add_room(room, sender.endpoint)  # no expect(): a gateway that died midway
    got = collect(receiver, {room}, timeout_s=10.0)[room]
    elapsed = time.monotonic() - start
    assert isinstance(got, TransferError) and got.kind == FailureKind.BOOTSTRAP_TIMEOUT, got
    assert got.reason.startswith("bootstrap_timeout: ")
    assert SHORT["bootstrap_timeout_s"] <= elapsed < 4 * SHORT["bootstrap_timeout_s"]
    assert sender_state(sender, room) == RoomState.FAILED
    assert_no_leaks(sender, receiver)


def test_unannounced_data_still_times_out(short_sender) -> None:
    s = spec(new_room(), 700)
    assert short_sender.ask("submit", s)  # no init will ever come
    assert short_sender.ask("call", "stats")["num_used_blocks"] > 0
    assert wait_for(lambda: sender_state(short_sender, s.seed) == RoomState.FAILED, 5.0)
    stats = short_sender.ask("wait_idle", 5.0)
    assert stats["num_used_blocks"] == 0 and stats["failed_by_reason"]["bootstrap_timeout"] >= 1


def test_a_receiver_that_could_not_listen_does_not_call_its_sender_dead(make_receiver) -> None:
    # the sender's own bound is long: only the receiver's judgement is under test
    config = make_config(num_blocks=64, **{**SHORT, "heartbeat_timeout_s": 30.0})
    sender = Peer("sender", config, layout_of(config))
    receiver = make_receiver(**{**SHORT, "waiting_timeout_s": 30.0})
    try:
        s, deadline = spec(new_room(), 700), time.monotonic() + 60.0
        sender.ask("call", "expect", s.seed, deadline)
        receiver.add_room(s.seed, sender.endpoint, deadline)
        assert wait_for(lambda: _acks(receiver) == 1)  # the encoder is working on it
        with receiver._lock:  # the loop cannot run: the sender's heartbeats queue up unread
            time.sleep(3 * SHORT["heartbeat_timeout_s"])
        time.sleep(2 * SHORT["heartbeat_interval_s"])  # the loop caught up with its inbox
        assert receiver.poll(s.seed) == RoomState.WAITING_FOR_INPUT, receiver.stats()
        assert sender.ask("submit", s)
        got = collect(receiver, {s.seed}, timeout_s=10.0)[s.seed]
        assert isinstance(got, ReceivedEmbeddings) and matches(
            got, make_request(s, receiver.layout)
        )
        receiver.release(s.seed)
        assert_no_leaks(sender, receiver)
    finally:
        sender.close()


def test_killed_sender_is_noticed_within_the_heartbeat_timeout(make_receiver) -> None:
    config = make_config(num_blocks=64, **SHORT)
    doomed = Peer("sender", config, layout_of(config))
    receiver = make_receiver(**SHORT)
    try:
        room, deadline = new_room(), time.monotonic() + 60.0
        doomed.ask("call", "expect", room, deadline)
        receiver.add_room(room, doomed.endpoint, deadline)
        assert wait_for(lambda: _acks(receiver) == 1)  # the encoder is working on it
        start = time.monotonic()
        doomed.kill()
        got = collect(receiver, {room}, timeout_s=10.0)[room]
        elapsed = time.monotonic() - start
        assert isinstance(got, TransferError) and got.kind == FailureKind.SENDER_DEAD, got
        assert elapsed < SHORT["heartbeat_timeout_s"] + 2 * SHORT["heartbeat_interval_s"] + 1.0
        assert wait_for(lambda: receiver.stats()["num_used_blocks"] == 0)  # after quarantine
    finally:
        doomed.close()


def test_request_deadline_fails_the_room_on_both_sides(short_sender, make_receiver) -> None:
    sender, receiver = short_sender, make_receiver(**SHORT)
    s = spec(new_room(), 1500)
    deadline = time.monotonic() + 2.5  # well past bootstrap_timeout_s: only the deadline ends it
    sender.ask("call", "expect", s.seed, deadline)
    receiver.add_room(s.seed, sender.endpoint, deadline)
    got = collect(receiver, {s.seed}, timeout_s=10.0)[s.seed]
    assert time.monotonic() >= deadline
    assert isinstance(got, TransferError) and got.kind == FailureKind.DEADLINE, got
    # the sender fails it at the same deadline, or on the receiver's abort if that came first
    assert wait_for(lambda: sender_state(sender, s.seed) == RoomState.FAILED)
    assert sender.ask("submit", s)  # the encoder finishes late: the data is dropped
    assert sender.ask("call", "stats")["messages"]["discarded_late_submits"] >= 1
    assert_no_leaks(sender, receiver)
    assert receiver.stats()["num_quarantined_blocks"] == 0


def test_request_deadline_frees_data_waiting_for_receiver_blocks(
    short_sender, make_receiver
) -> None:
    sender, receiver = short_sender, make_receiver(**SHORT, num_blocks=8)
    failed = sender.ask("call", "stats")["failed_by_reason"]
    before = failed.get("deadline", 0) + failed.get("aborted", 0)
    deadline = time.monotonic() + 2.5
    s, hog = _queued_for_blocks(sender, receiver, deadline)
    time.sleep(2 * SHORT["waiting_timeout_s"])  # queueing for blocks is not a timeout
    assert receiver.poll(s.seed) == RoomState.BOOTSTRAPPING
    assert sender_state(sender, s.seed) == RoomState.BOOTSTRAPPING
    got = collect(receiver, {s.seed}, timeout_s=10.0)[s.seed]
    assert isinstance(got, TransferError) and got.kind == FailureKind.DEADLINE, got
    assert wait_for(lambda: sender_state(sender, s.seed) == RoomState.FAILED)
    # the room was only claimed: the sender failed it at the deadline by itself, or on the
    # receiver's abort if that came first
    failed = sender.ask("call", "stats")["failed_by_reason"]
    assert failed.get("deadline", 0) + failed.get("aborted", 0) == before + 1
    receiver.allocator.free(hog)
    assert_no_leaks(sender, receiver)


def test_restarted_sender_fails_the_rooms_of_its_previous_life(make_receiver) -> None:
    patient = dict(SHORT, heartbeat_timeout_s=60.0)  # silence alone would take a minute
    config = make_config(num_blocks=64, **patient)
    first = Peer("sender", config, layout_of(config))
    receiver = make_receiver(**patient)
    port = int(first.endpoint.rsplit(":", 1)[1])
    second = None
    try:
        old, deadline = new_room(), time.monotonic() + 60.0
        first.ask("call", "expect", old, deadline)
        receiver.add_room(old, first.endpoint, deadline)
        assert wait_for(lambda: _acks(receiver) == 1)
        first.kill()
        second = Peer(
            "sender", make_config(num_blocks=64, control_port=port, **patient), layout_of(config)
        )
        assert second.endpoint == first.endpoint
        s = spec(new_room(), 300)
        second.ask("call", "expect", s.seed, deadline)
        receiver.add_room(s.seed, second.endpoint, deadline)  # answered by the new process
        got = collect(receiver, {old}, timeout_s=10.0)[old]
        assert isinstance(got, TransferError) and got.kind == FailureKind.PEER_RESTARTED, got
        assert second.ask("submit", s)
        done = collect(receiver, {s.seed})[s.seed]
        assert isinstance(done, ReceivedEmbeddings)
        assert matches(done, make_request(s, receiver.layout))
        receiver.release(s.seed)
        assert_no_leaks(second, receiver)
    finally:
        first.close()
        if second is not None:
            second.close()
