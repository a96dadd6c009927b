"""Cancellation: ``EmbeddingSender.fail(room, reason)`` in every state of the room.

Its blocks are free when ``fail`` returns unless a write is in flight (then as soon as the write
returns), the receiver is told (FAILED, ``encode_failed``, with ``write_in_flight`` when it must
keep its blocks), and data submitted afterwards is dropped. The sender lives in this process so
its blocks can be counted the instant ``fail`` returns; writes are held open with a gate around
the real transport; a receiver that never asks for the rest is a ``Forger`` sending a real init
for a real receiver's blocks.
"""

from __future__ import annotations

import time

import pytest

from bench.synthetic import make_request
from common.transfer.receiver import EmbeddingReceiver
from common.transfer.sender import EmbeddingSender
from common.transfer.types import FailureKind, RoomState, TransferError
from protos.epd.v1 import transfer_pb2

from .conftest import layout_of, make_config, new_room, wait_for
from .forge import Forger
from .helpers import collect, spec
from .test_write_queue import GatedWrites


@pytest.fixture
def pair():
    config = make_config(num_blocks=64, transport="shm")
    sender = EmbeddingSender(config, layout_of(config))
    receiver = EmbeddingReceiver(config, layout_of(config))
    yield sender, receiver
    receiver.close()
    sender.close()


def _submit(sender: EmbeddingSender, s) -> None:
    req = make_request(s, sender.layout)
    assert sender.submit(
        s.seed, req.fill_ids, req.positions, req.image_rows, req.aux, req.image_mask
    )


def _encode_failed(receiver: EmbeddingReceiver, room: int) -> TransferError:
    got = collect(receiver, {room})[room]
    assert isinstance(got, TransferError) and got.kind == FailureKind.ENCODE_FAILED, got
    assert got.reason == "encode_failed: cancelled by the client"
    return got


def _late_data_is_dropped(sender: EmbeddingSender, s) -> None:
    dropped = sender.stats()["messages"].get("discarded_late_submits", 0)
    _submit(sender, s)
    assert sender.stats()["messages"]["discarded_late_submits"] == dropped + 1
    assert sender.stats()["num_used_blocks"] == 0 and sender.poll(s.seed) == RoomState.FAILED


def _idle(sender: EmbeddingSender, receiver: EmbeddingReceiver) -> None:
    assert wait_for(lambda: receiver.stats()["num_used_blocks"] == 0)
    assert receiver.stats()["num_quarantined_blocks"] == 0
    assert sender.stats()["num_used_blocks"] == 0
    assert not sender.stats()["rooms_active"] and not receiver.stats()["rooms_active"]


@pytest.mark.parametrize("held", ["announced", "data"])
def test_before_the_receiver_asked(pair, held: str) -> None:
    sender, receiver = pair
    s = spec(new_room(), 700)
    sender.expect(s.seed, time.monotonic() + 60.0)
    if held == "data":
        _submit(sender, s)
        assert sender.stats()["num_used_blocks"] == 6
    sender.fail(s.seed, "cancelled by the client")
    assert sender.stats()["num_used_blocks"] == 0  # at once
    receiver.add_room(s.seed, sender.endpoint)  # the init comes later: answered FAILED
    _encode_failed(receiver, s.seed)
    _late_data_is_dropped(sender, s)
    _idle(sender, receiver)


def test_init_waiting_for_data(pair) -> None:
    sender, receiver = pair
    s = spec(new_room(), 700)
    sender.expect(s.seed, time.monotonic() + 60.0)
    receiver.add_room(s.seed, sender.endpoint)
    assert wait_for(lambda: sender.poll(s.seed) == RoomState.WAITING_FOR_INPUT)
    sender.fail(s.seed, "cancelled by the client")
    assert sender.poll(s.seed) == RoomState.FAILED
    _encode_failed(receiver, s.seed)
    _late_data_is_dropped(sender, s)
    _idle(sender, receiver)  # nothing was in flight: the receiver's blocks are free at once


def test_write_queued_behind_another(pair) -> None:
    sender, receiver = pair
    gated = GatedWrites(sender.shm.write)
    sender.shm.write = gated
    first, queued = spec(new_room(), 600), spec(new_room(), 600)
    for s in (first, queued):
        _submit(sender, s)
        receiver.add_room(s.seed, sender.endpoint)
    try:
        assert gated.first_started.wait(10.0)
        assert wait_for(lambda: sender.poll(queued.seed) == RoomState.TRANSFERRING)
        sender.fail(queued.seed, "cancelled by the client")
        assert sender.stats()["num_used_blocks"] == 5  # only the held write's room
        got = _encode_failed(receiver, queued.seed)
        assert got.kind == FailureKind.ENCODE_FAILED
        assert receiver.stats()["num_quarantined_blocks"] == 0  # told: nothing in flight
    finally:
        gated.gate.set()
    assert collect(receiver, {first.seed})[first.seed].num_transfers == 1
    receiver.release(first.seed)
    assert gated.num_calls == 1  # the cancelled room was never written
    _idle(sender, receiver)


def test_write_in_flight(pair) -> None:
    sender, receiver = pair
    gated = GatedWrites(sender.shm.write)
    sender.shm.write = gated
    s = spec(new_room(), 600)
    _submit(sender, s)
    receiver.add_room(s.seed, sender.endpoint)
    try:
        assert gated.first_started.wait(10.0)  # the transport is writing the room
        sender.fail(s.seed, "cancelled by the client")
        assert sender.poll(s.seed) == RoomState.FAILED
        assert sender.stats()["num_used_blocks"] == 5  # a write may still read them
        _encode_failed(receiver, s.seed)
        assert receiver.stats()["num_quarantined_blocks"] == 8  # and land in these (1024 tok)
    finally:
        gated.gate.set()  # the write returns: freed, and the receiver gets the all-clear
    assert wait_for(lambda: sender.stats()["num_used_blocks"] == 0)
    _idle(sender, receiver)
    _late_data_is_dropped(sender, s)


def test_waiting_for_a_continuation(pair) -> None:
    sender, receiver = pair
    s = spec(new_room(), 700)
    _submit(sender, s)
    blocks = receiver.allocator.alloc(128)  # real blocks of a real receiver, asked for by hand
    slow = Forger()  # a receiver that never asks for the rest
    try:
        env = slow.envelope(sender.endpoint)
        env.init.CopyFrom(receiver._make_init_template())
        env.init.room, env.init.receiver_endpoint = s.seed, slow.endpoint
        env.init.block_ids.extend(blocks.block_ids)
        env.init.num_tokens_allocated = 128
        slow.push(sender.endpoint, slow.seal(env))
        assert wait_for(lambda: sender.stats()["num_transfers"] == 1)
        assert sender.poll(s.seed) == RoomState.TRANSFERRING
        sender.fail(s.seed, "cancelled by the client")
        assert sender.stats()["num_used_blocks"] == 0  # no write in flight: freed at once
        statuses = [e.status for e in slow.replies() if e.WhichOneof("body") == "status"]
        assert [st.state for st in statuses][-2:] == [
            transfer_pb2.TRANSFER_STATE_TRANSFERRING,
            transfer_pb2.TRANSFER_STATE_FAILED,
        ]
        assert statuses[-1].error_kind == FailureKind.ENCODE_FAILED
        assert not statuses[-1].write_in_flight
    finally:
        slow.close()
        receiver.allocator.free(blocks)
    _late_data_is_dropped(sender, s)
