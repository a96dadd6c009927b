"""The control channel's bounds: peer sockets (LRU, idle), frame size, wake-ups.

Real ZMQ sockets on 127.0.0.1; the far ends are ``Forger`` sinks.
"""

from __future__ import annotations

import threading
import time

from common.transfer import messages
from common.transfer.auth import FrameAuth
from common.transfer.control import MAX_FRAME_BYTES, ControlChannel

from .conftest import wait_for
from .forge import Forger


def _heartbeat(origin: str):
    env = messages.envelope(origin, 7)
    env.heartbeat.sent_at = 1.0
    return env


def test_peer_sockets_are_bounded_and_least_recently_used_go_first() -> None:
    channel = ControlChannel("127.0.0.1", 0, FrameAuth(None, 10.0), max_peers=3, idle_s=60.0)
    sinks = [Forger() for _ in range(5)]
    try:
        for sink in sinks[:3]:
            assert channel.send(sink.endpoint, _heartbeat(channel.endpoint))
        channel.send(sinks[0].endpoint, _heartbeat(channel.endpoint))  # 0 is used again
        for sink in sinks[3:]:
            channel.send(sink.endpoint, _heartbeat(channel.endpoint))
        assert channel.num_sockets == 3
        assert channel.num_sockets_closed == 2  # sinks 1 and 2, the least recently used
        assert len(sinks[0].replies(0.3)) == 2 and len(sinks[4].replies(0.3)) == 1
        channel.send(sinks[1].endpoint, _heartbeat(channel.endpoint))  # reopened on demand
        assert len(sinks[1].replies(0.3)) == 2 and channel.num_sockets == 3
    finally:
        channel.close()
        for sink in sinks:
            sink.close()


def test_idle_peer_sockets_are_closed() -> None:
    channel = ControlChannel("127.0.0.1", 0, FrameAuth(None, 10.0), max_peers=8, idle_s=0.2)
    sink = Forger()
    try:
        channel.send(sink.endpoint, _heartbeat(channel.endpoint))
        assert channel.num_sockets == 1
        time.sleep(0.3)
        channel.close_idle()
        assert (channel.num_sockets, channel.num_sockets_closed) == (0, 1)
    finally:
        channel.close()
        sink.close()


def test_oversized_frames_never_reach_the_endpoint(make_receiver) -> None:
    receiver = make_receiver()
    forger = Forger()
    try:
        frame = forger.seal(_heartbeat(forger.endpoint))
        forger.push(receiver.endpoint, frame + b"\x00" * MAX_FRAME_BYTES)  # garbage tail
        time.sleep(0.3)
        assert receiver.stats()["messages"].get("received", 0) == 0
        other = Forger()  # the endpoint keeps serving everyone else
        try:
            other.push(receiver.endpoint, other.seal(_heartbeat(other.endpoint)))
            assert wait_for(lambda: receiver.stats()["messages"].get("handled", 0) == 1)
        finally:
            other.close()
    finally:
        forger.close()


def test_wake_returns_a_blocked_recv() -> None:
    channel = ControlChannel("127.0.0.1", 0, FrameAuth(None, 10.0))
    returned = threading.Event()

    def block() -> None:
        assert channel.recv(None) == []
        returned.set()

    thread = threading.Thread(target=block, daemon=True)
    try:
        thread.start()
        assert not returned.wait(0.3)  # no timeout: it sleeps until something happens
        channel.wake()
        assert returned.wait(2.0)
    finally:
        channel.wake()
        thread.join(2.0)
        channel.close()


def test_an_alarm_set_by_another_thread_returns_a_blocked_recv_at_its_time() -> None:
    channel = ControlChannel("127.0.0.1", 0, FrameAuth(None, 10.0))
    assert channel.alarm  # Linux: a timerfd
    returned = threading.Event()
    woke_at: list[float] = []

    def block() -> None:
        assert channel.recv(None) == []
        woke_at.append(time.monotonic())
        returned.set()

    thread = threading.Thread(target=block, daemon=True)
    try:
        thread.start()
        channel.set_alarm(time.monotonic() + 60.0)
        assert not returned.wait(0.3)  # set from here, without waking the sleeper now
        due = time.monotonic() + 0.2
        channel.set_alarm(due)  # an earlier time replaces the later one
        assert returned.wait(5.0)
        assert woke_at[0] >= due
    finally:
        channel.wake()
        thread.join(2.0)
        channel.close()


def test_a_disarmed_or_read_alarm_does_not_return_recv_again() -> None:
    channel = ControlChannel("127.0.0.1", 0, FrameAuth(None, 10.0))
    try:
        channel.set_alarm(time.monotonic() - 1.0)  # already due: rings at once
        assert channel.recv(2000) == []
        start = time.monotonic()
        assert channel.recv(300) == []  # read by the first recv: this one times out
        assert time.monotonic() - start >= 0.25
        channel.set_alarm(time.monotonic() + 0.1)
        channel.set_alarm(None)  # disarmed before it rang
        start = time.monotonic()
        assert channel.recv(400) == []
        assert time.monotonic() - start >= 0.35
    finally:
        channel.close()
