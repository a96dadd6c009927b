"""Authenticated control frames: HMAC trailer, replay guard, and what is never acted on.

Sender in its own process, receiver in this one, both with the same secret file; forged frames
come from a ``Forger`` socket that either lacks the secret, has a wrong one, or has the right
one but replays, back-dates or mis-addresses a frame.
"""

from __future__ import annotations

import time

import pytest

from bench.peer import Peer
from bench.synthetic import make_request, matches
from common.transfer.auth import FrameAuth, ReplayGuard, load_secret
from common.transfer.config import TransferConfig
from common.transfer.types import FailureKind, ReceivedEmbeddings, RoomState, TransferError
from protos.epd.v1 import transfer_pb2

from .conftest import assert_no_leaks, layout_of, make_config, new_room, wait_for
from .forge import Forger
from .helpers import collect, sender_state, spec

SECRET = b"s3cret-for-the-transfer-plane-tests"


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("secret") / "transfer-secret"
    path.write_bytes(SECRET + b"\n")  # as `echo` or a Secret's editor leaves it
    return str(path)


@pytest.fixture(scope="module")
def auth_sender(secret_file: str):
    config = make_config(num_blocks=64, secret_file=secret_file)
    peer = Peer("sender", config, layout_of(config))
    yield peer
    peer.close()


def _messages(stats: dict) -> dict:
    return stats["messages"]


def test_secret_file_problems_are_clear_start_up_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="missing-file.*cannot be read"):
        TransferConfig(secret_file=str(tmp_path / "missing-file"))
    short = tmp_path / "short"
    short.write_bytes(b"tiny-secret\n")
    with pytest.raises(ValueError, match="holds 11 bytes") as info:
        TransferConfig(secret_file=str(short))
    assert "tiny-secret" not in str(info.value)  # the content is never echoed
    good = tmp_path / "good"
    good.write_bytes(SECRET + b"\r\n")
    assert load_secret(str(good)) == SECRET


def test_seal_and_open() -> None:
    auth, other = FrameAuth(SECRET, 10.0), FrameAuth(b"another-secret-of-16+", 10.0)
    env = transfer_pb2.TransferEnvelope(version=1, from_endpoint="tcp://127.0.0.1:1")
    payload = env.SerializeToString()
    frame = auth.seal(payload)
    assert auth.open(frame) == payload
    assert other.open(frame) is None  # a wrong key
    assert auth.open(payload) is None  # no trailer
    tampered = bytearray(frame)
    tampered[3] ^= 1
    assert auth.open(bytes(tampered)) is None
    assert FrameAuth(None, 10.0).open(frame) == frame  # development: the trailer is a field


def test_freshness_checks() -> None:
    auth = FrameAuth(SECRET, 10.0)
    me = "tcp://127.0.0.1:5"
    env = transfer_pb2.TransferEnvelope(
        version=1, incarnation=9, seq=1, sent_at_ms=int(time.time() * 1000), to_endpoint=me
    )
    assert auth.check(env, me) == ""
    assert auth.check(env, me) == "replayed"
    env.seq = 2
    assert auth.check(env, "tcp://127.0.0.1:6") == "misdirected"
    env.sent_at_ms -= 60_000
    assert auth.check(env, me) == "stale"
    assert FrameAuth(None, 10.0).check(env, "elsewhere") == ""


def test_replay_guard_window() -> None:
    guard = ReplayGuard()
    assert guard.accept(1, 10) and guard.accept(1, 12) and guard.accept(1, 11)
    assert not guard.accept(1, 11) and not guard.accept(1, 12)
    assert guard.accept(1, 5000) and not guard.accept(1, 12)  # fell out of the window
    assert guard.accept(2, 12)  # another sender process
    assert not guard.accept(3, 0)
    assert guard.accept(4, 2**64 - 1) and not guard.accept(4, 1)  # far below: no huge shift


def test_unauthenticated_frames_are_dropped_counted_and_never_acted_on(
    auth_sender, make_receiver, secret_file
) -> None:
    sender, receiver = auth_sender, make_receiver(secret_file=secret_file)
    s = spec(new_room(), 1500)
    deadline = time.monotonic() + 60.0
    sender.ask("call", "expect", s.seed, deadline)
    receiver.add_room(s.seed, sender.endpoint, deadline)
    assert wait_for(lambda: _messages(receiver.stats()).get("acknowledged_inits", 0) == 1)
    sender_before = _messages(sender.ask("call", "stats"))
    sockets_before = sender.ask("call", "stats")["num_control_sockets"]
    stranger, wrong_key = Forger(), Forger(secret=b"not-the-deployment-secret")
    try:
        for forger in (stranger, wrong_key):
            # to the sender: an abort of the live room posing as its receiver, an init of a
            # new room, an abort of an unknown room (which a real peer would get answered)
            abort = forger.envelope(sender.endpoint, from_endpoint=receiver.endpoint)
            abort.abort.room = s.seed
            init = forger.envelope(sender.endpoint)
            init.init.room, init.init.receiver_endpoint = new_room(), forger.endpoint
            unknown = forger.envelope(sender.endpoint)
            unknown.abort.room = new_room()
            forger.push(sender.endpoint, *(forger.seal(e) for e in (abort, init, unknown)))
            # to the receiver: the live room FAILED, posing as its sender
            status = forger.envelope(receiver.endpoint, from_endpoint=sender.endpoint)
            status.status.room, status.status.state = s.seed, transfer_pb2.TRANSFER_STATE_FAILED
            forger.push(receiver.endpoint, forger.seal(status))

        def dropped(stats: dict) -> int:
            return _messages(stats).get("dropped_unauthenticated", 0)

        assert wait_for(lambda: dropped(sender.ask("call", "stats")) == 6)
        assert wait_for(lambda: dropped(receiver.stats()) == 2)
        after = _messages(sender.ask("call", "stats"))
        assert after["handled"] == sender_before["handled"]  # nothing forged got through
        assert stranger.replies(0.3) == [] and wrong_key.replies(0.1) == []  # never answered
        assert sender.ask("call", "stats")["num_control_sockets"] == sockets_before
        assert sender_state(sender, s.seed) == RoomState.WAITING_FOR_INPUT
        assert receiver.poll(s.seed) == RoomState.WAITING_FOR_INPUT
    finally:
        stranger.close()
        wrong_key.close()
    assert sender.ask("submit", s)  # the real room goes on
    got = collect(receiver, {s.seed})[s.seed]
    assert isinstance(got, ReceivedEmbeddings) and matches(got, make_request(s, receiver.layout))
    receiver.release(s.seed)
    assert_no_leaks(sender, receiver)


def test_replayed_stale_and_misdirected_frames_are_dropped(auth_sender, make_receiver) -> None:
    sender = auth_sender
    insider = Forger(secret=SECRET)  # holds the secret: its fresh frames are answered
    try:
        abort = insider.envelope(sender.endpoint)
        abort.abort.room = new_room()  # unknown: answered with FAILED, nothing in flight
        frame = insider.seal(abort)
        insider.push(sender.endpoint, frame)
        replies = insider.replies()
        assert [r.status.error_kind for r in replies] == [FailureKind.ABORTED]
        before = _messages(sender.ask("call", "stats"))
        stale = insider.envelope(sender.endpoint, sent_at_ms=int(time.time() * 1000) - 3_600_000)
        stale.abort.room = new_room()
        misdirected = insider.envelope("tcp://127.0.0.1:9")  # meant for another endpoint
        misdirected.abort.room = new_room()
        insider.push(sender.endpoint, frame, insider.seal(stale), insider.seal(misdirected))

        def dropped(key: str) -> int:
            return _messages(sender.ask("call", "stats")).get(key, 0) - before.get(key, 0)

        assert wait_for(lambda: dropped("received") == 3)
        assert (dropped("dropped_replayed"), dropped("dropped_stale")) == (1, 1)
        assert dropped("dropped_misdirected") == 1 and dropped("handled") == 0
        assert insider.replies(0.3) == []
    finally:
        insider.close()


def test_peers_with_different_secrets_never_talk(auth_sender, make_receiver, tmp_path) -> None:
    other = tmp_path / "other-secret"
    other.write_bytes(b"a-different-deployment-secret")
    receiver = make_receiver(secret_file=str(other))
    before = _messages(auth_sender.ask("call", "stats")).get("dropped_unauthenticated", 0)
    room = new_room()
    receiver.add_room(room, auth_sender.endpoint)
    got = collect(receiver, {room}, timeout_s=10.0)[room]
    # the sender never heard the init, so it never heartbeats: silent within the timeout
    assert isinstance(got, TransferError) and got.kind == FailureKind.SENDER_DEAD
    after = _messages(auth_sender.ask("call", "stats")).get("dropped_unauthenticated", 0)
    assert after - before >= 2  # the init and the receiver's heartbeats and abort
    assert sender_state(auth_sender, room) is None
