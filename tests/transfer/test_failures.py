"""Scenarios where rooms fail: every failure reaches both sides and no block leaks."""

from __future__ import annotations

import time

import zmq

from bench.peer import Peer
from bench.synthetic import make_request
from common.transfer import messages
from common.transfer.sender import EmbeddingSender
from common.transfer.types import ReceivedEmbeddings, RoomState, TransferError
from protos.epd.v1 import transfer_pb2

from .conftest import assert_no_leaks, layout_of, make_config, new_room, wait_for
from .helpers import collect, run_rooms, sender_state, spec


def test_first_transfer_fails_when_encode_fails(sender, make_receiver) -> None:
    receiver = make_receiver()
    before, after = spec(new_room(), 500), spec(new_room(), 500)
    sender.ask("call", "fail", before.seed, "bad image")  # fails before the init arrives
    receiver.add_room(before.seed, sender.endpoint)
    receiver.add_room(after.seed, sender.endpoint)
    assert wait_for(lambda: sender_state(sender, after.seed) == RoomState.WAITING_FOR_INPUT)
    sender.ask("call", "fail", after.seed, "bad image")
    results = collect(receiver, {before.seed, after.seed})
    for result in results.values():
        assert isinstance(result, TransferError) and "fail" in result.reason
    assert sender.ask("submit", after)  # late data of a failed room is dropped, not kept
    assert_no_leaks(sender, receiver)


def test_layout_mismatch_fails_with_clear_reason(sender, make_receiver) -> None:
    receiver = make_receiver(hidden=32)
    s = spec(new_room(), 300)
    assert sender.ask("submit", s)
    receiver.add_room(s.seed, sender.endpoint)
    result = collect(receiver, {s.seed})[s.seed]
    assert isinstance(result, TransferError)
    assert result.reason.startswith("layout_mismatch") and "hidden=32" in result.reason
    assert sender.ask("call", "stats")["failed_by_reason"]["layout_mismatch"] >= 1
    assert_no_leaks(sender, receiver)


def _mid_room(sender: Peer, receiver, total: int = 20000) -> int:
    """A room crawling through 128-token continuations, caught while TRANSFERRING."""
    s = spec(new_room(), total)
    assert sender.ask("submit", s)
    receiver.add_room(s.seed, sender.endpoint)
    assert wait_for(lambda: receiver.poll(s.seed) == RoomState.TRANSFERRING, 10.0)
    return s.seed


def test_continuation_fails_partial_data_dropped(sender, make_receiver) -> None:
    receiver = make_receiver(num_blocks=1, default_tokens=128)
    room = _mid_room(sender, receiver)
    sender.ask("call", "fail", room, "encoder crashed")
    result = collect(receiver, {room})[room]
    assert isinstance(result, TransferError) and result.reason.startswith("encode_failed")
    assert receiver.stats()["rooms_active"] == {}
    assert_no_leaks(sender, receiver)
    ok = spec(new_room(), 300)
    run_rooms(sender, receiver, [ok])  # the buffer is usable again
    assert_no_leaks(sender, receiver)


def test_receiver_abort_mid_room_quarantines_until_acknowledged(sender, make_receiver) -> None:
    receiver = make_receiver(num_blocks=1, default_tokens=128)
    room = _mid_room(sender, receiver)
    receiver.abort(room)
    assert receiver.pop_done() == []  # aborted rooms are not reported
    assert wait_for(lambda: sender_state(sender, room) == RoomState.FAILED)
    assert_no_leaks(sender, receiver)
    assert receiver.stats()["num_quarantined_blocks"] == 0


def test_receiver_dies_mid_room() -> None:
    config = make_config(num_blocks=256)
    sender = EmbeddingSender(config, layout_of(config))
    receiver_config = make_config(num_blocks=1, default_tokens=128)
    receiver = Peer("receiver", receiver_config, layout_of(receiver_config))
    try:
        s = spec(new_room(), 20000)
        req = make_request(s, sender.layout)
        args = (req.fill_ids, req.positions, req.image_rows, req.aux, req.image_mask)
        assert sender.submit(s.seed, *args)
        receiver.ask("call", "add_room", s.seed, sender.endpoint)
        assert wait_for(lambda: sender.poll(s.seed) == RoomState.TRANSFERRING)
        receiver.kill()
        assert wait_for(lambda: sender.poll(s.seed) == RoomState.FAILED, 5.0)
        stats = sender.stats()
        assert set(stats["failed_by_reason"]) <= {
            "receiver_dead",
            "transfer_timeout",
            "write_failed",
        }
        assert wait_for(lambda: sender.stats()["num_used_blocks"] == 0, 10.0)
    finally:
        receiver.close()
        sender.close()


def test_sender_dies_mid_room(make_receiver) -> None:
    config = make_config(num_blocks=256)
    doomed = Peer("sender", config, layout_of(config))
    receiver = make_receiver(num_blocks=1, default_tokens=128)
    try:
        room = _mid_room(doomed, receiver)
        doomed.kill()
        result = collect(receiver, {room}, timeout_s=10.0)[room]
        assert isinstance(result, TransferError)
        assert result.reason.split(":")[0] in {"sender_dead", "timeout"}
        assert wait_for(lambda: receiver.stats()["num_used_blocks"] == 0, 10.0)
    finally:
        doomed.close()


def _push(endpoint: str, frames: list[bytes]) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(endpoint)
    for frame in frames:
        sock.send(frame)
    sock.close()


def _bad_frames() -> list[bytes]:
    status = messages.envelope("tcp://127.0.0.1:1")
    status.status.room = 424242
    status.status.state = transfer_pb2.TRANSFER_STATE_SUCCESS
    future = transfer_pb2.TransferEnvelope()
    future.CopyFrom(status)
    future.version = 9
    valid = status.SerializeToString()
    return [b"\x00\xff garbage \xff", valid[: len(valid) // 2], future.SerializeToString(), b""]


def test_garbage_truncated_and_unknown_version_are_dropped(sender, make_receiver) -> None:
    receiver = make_receiver()
    frames = _bad_frames()
    _push(receiver.endpoint, frames)
    _push(sender.endpoint, frames)

    def dropped(stats: dict) -> int:
        return sum(v for k, v in stats["messages"].items() if k.startswith("dropped_"))

    assert wait_for(lambda: dropped(receiver.stats()) == len(frames))
    assert wait_for(lambda: dropped(sender.ask("call", "stats")) >= len(frames))
    assert receiver.stats()["messages"]["dropped_unknown_version"] >= 1
    run_rooms(sender, receiver, [spec(new_room(), 1500)])  # both ends still work
    assert_no_leaks(sender, receiver)


def test_unknown_rooms_and_added_fields_interoperate(sender, make_receiver) -> None:
    receiver = make_receiver()
    status = messages.envelope("tcp://127.0.0.1:1")
    status.status.room = 777_777
    status.status.state = transfer_pb2.TRANSFER_STATE_TRANSFERRING
    newer = status.SerializeToString() + bytes([0xF8, 0x06, 0x2A])  # unknown field 111
    abort = messages.envelope(receiver.endpoint)
    abort.abort.room = 888_888
    _push(receiver.endpoint, [status.SerializeToString(), newer])
    _push(sender.endpoint, [abort.SerializeToString()])
    assert wait_for(lambda: receiver.stats()["messages"].get("unknown_room", 0) >= 2)
    assert wait_for(lambda: sender.ask("call", "stats")["messages"].get("unknown_room", 0) >= 1)
    results = run_rooms(sender, receiver, [spec(new_room(), 200)])
    assert all(isinstance(r, ReceivedEmbeddings) for r in results.values())
    assert_no_leaks(sender, receiver)


def test_bootstrap_timeout_when_data_never_comes(sender, make_receiver) -> None:
    receiver = make_receiver()
    room = new_room()
    start = time.monotonic()
    receiver.add_room(room, sender.endpoint)
    result = collect(receiver, {room}, timeout_s=10.0)[room]
    assert isinstance(result, TransferError) and "bootstrap_timeout" in result.reason
    assert time.monotonic() - start < 8.0
    assert_no_leaks(sender, receiver)
