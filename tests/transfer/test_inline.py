"""Minor 6: a small chunk's token fields and aux record ride in its status over Mooncake."""

from __future__ import annotations

from common.transfer.chunks import MAX_INLINE_TOKENS
from common.transfer.receiver_room import ReceiverRoom
from common.transfer.types import RoomState
from protos.epd.v1 import transfer_pb2

from .conftest import assert_no_leaks, new_room
from .helpers import run_rooms, spec


def _spy_inline(receiver) -> list[tuple[int, int]]:
    """(room, inline bytes) of every status the receiver stores inline fields from."""
    seen: list[tuple[int, int]] = []
    store = receiver._store_inline

    def spy(state, status):
        size = len(status.inline_fill_ids) + len(status.inline_positions)
        if size or status.inline_aux:
            seen.append((state.room, size + len(status.inline_aux)))
        return store(state, status)

    receiver._store_inline = spy
    return seen


def test_small_chunks_come_inline_large_ones_as_segments(sender, make_receiver) -> None:
    receiver = make_receiver(default_tokens=2048)
    inline = _spy_inline(receiver)
    small, text_only, large = new_room(), new_room(), new_room()
    specs = [spec(small, 300, 1), spec(text_only, 700, 0), spec(large, MAX_INLINE_TOKENS + 1)]
    before = sender.ask("call", "stats")["bytes_sent"]
    run_rooms(sender, receiver, specs)  # byte-exact
    assert sorted(room for room, _ in inline) == [small, text_only]
    assert dict(inline)[small] > 300 * 16  # fill ids, positions and the aux record
    # inline bytes count as sent: rows + 16 bytes per token + one aux record per chunk
    sent = sender.ask("call", "stats")["bytes_sent"] - before
    row_bytes = receiver.layout.row_bytes
    rows = 1 + 0 + (MAX_INLINE_TOKENS + 1) // 2
    assert sent > rows * row_bytes + (300 + 700 + MAX_INLINE_TOKENS + 1) * 16
    assert_no_leaks(sender, receiver)


def test_receiver_without_inline_gets_every_field_written(sender, make_receiver) -> None:
    receiver = make_receiver()
    receiver._init_template.accepts_inline = False  # as a receiver of minor < 6
    inline = _spy_inline(receiver)
    specs = [spec(new_room(), 300, 1), spec(new_room(), 700, 0)]
    run_rooms(sender, receiver, specs)  # byte-exact
    assert inline == []
    assert_no_leaks(sender, receiver)


def test_inline_fields_of_the_wrong_size_are_refused(make_receiver) -> None:
    receiver = make_receiver()
    with receiver._lock:
        state = ReceiverRoom(new_room(), "tcp://127.0.0.1:1")
        state.allocation = receiver.allocator.alloc(128)
        try:
            cases = {
                "does not fit": dict(num_tokens=129, fill=129 * 4, pos=129 * 12, aux=64),
                "token fields": dict(num_tokens=2, fill=8, pos=12, aux=64),
                "aux record": dict(num_tokens=2, fill=8, pos=24, aux=4096),
            }
            for expected, case in cases.items():
                status = transfer_pb2.TransferStatus(
                    state=int(RoomState.SUCCESS),
                    num_tokens=case["num_tokens"],
                    inline_fill_ids=bytes(case["fill"]),
                    inline_positions=bytes(case["pos"]),
                    inline_aux=bytes(case["aux"]),
                )
                assert expected in receiver._store_inline(state, status)
            fine = transfer_pb2.TransferStatus(
                num_tokens=2, inline_fill_ids=bytes(8), inline_positions=bytes(24), inline_aux=b"x"
            )
            assert receiver._store_inline(state, fine) == ""
        finally:
            receiver.allocator.free(state.allocation)
