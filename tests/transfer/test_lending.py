"""Zero-copy delivery: a room that arrives whole in one chunk keeps its blocks as its rows.

Real Mooncake over tcp, sender in another process; every byte is checked before release.
"""

from __future__ import annotations

from bench.synthetic import make_request, matches
from common.transfer.types import ReceivedEmbeddings

from .conftest import assert_no_leaks, new_room
from .helpers import collect, spec


def _receive(sender, receiver, specs) -> dict[int, ReceivedEmbeddings]:
    assert sender.ask("submit_all", specs)
    for s in specs:
        receiver.add_room(s.seed, sender.endpoint)
    results = collect(receiver, {s.seed for s in specs})
    for s in specs:
        assert isinstance(results[s.seed], ReceivedEmbeddings), results[s.seed]
        assert matches(results[s.seed], make_request(s, receiver.layout)), s
    return results  # type: ignore[return-value]


def _rows_in_buffer(receiver, got: ReceivedEmbeddings) -> bool:
    region = receiver.buffers.regions["rows"]
    return region.base <= got.image_rows.data_ptr() < region.base + region.nbytes


def test_whole_room_is_lent_until_released(sender, make_receiver) -> None:
    receiver = make_receiver(num_blocks=32, default_tokens=1024)
    s = spec(new_room(), 900, 600)
    got = _receive(sender, receiver, [s])[s.seed]
    assert got.lent and _rows_in_buffer(receiver, got)
    assert got.transfer_s > 0  # from the status's write time: no announcement for one chunk
    stats = receiver.stats()
    assert (stats["num_lent_rooms"], stats["num_lent_blocks"]) == (1, 8)
    assert stats["num_used_blocks"] == 8  # the blocks of 900 tokens; the rest went back
    receiver.release(s.seed)
    receiver.release(s.seed)  # idempotent
    assert receiver.stats()["num_lent_blocks"] == 0
    assert receiver.stats()["num_rooms_lent"] == 1
    assert_no_leaks(sender, receiver)


def test_continuation_lands_behind_the_first_chunk(sender, make_receiver) -> None:
    # 1500 tokens, 1000 of them one image somewhere inside: the first chunk (1024) carries text
    # tokens too, so the continuation's rows start at a row slot below its token slot.
    receiver = make_receiver(num_blocks=32, default_tokens=1024)
    s = spec(new_room(), 1500, 1000)
    got = _receive(sender, receiver, [s])[s.seed]
    assert got.num_transfers == 2
    assert got.lent and _rows_in_buffer(receiver, got)
    assert receiver.stats()["num_lent_blocks"] == 12  # ceil(1500 / 128): extended, not copied
    # asked for at the sender's announcement, while the first chunk was still being written
    assert receiver.stats()["messages"]["continuation_ahead"] == 1
    receiver.release(s.seed)
    assert_no_leaks(sender, receiver)


def test_scattered_blocks_and_large_rooms_are_copied(sender, make_receiver) -> None:
    receiver = make_receiver(num_blocks=32, default_tokens=1024, max_lent_fraction=0.75)
    first, second = spec(new_room(), 700, 700), spec(new_room(), 700, 700)
    _receive(sender, receiver, [first])  # lent: blocks 0..5
    _receive(sender, receiver, [second])  # lent: blocks 6..11
    receiver.release(first.seed)  # free: 0..5, 12..31
    scattered = spec(new_room(), 1500, 1400)  # blocks 0..5, 12, 13, then 14..17
    got = _receive(sender, receiver, [scattered])[scattered.seed]
    assert got.num_transfers == 2 and not got.lent  # rows in two runs: copied once at the end
    text_only = spec(new_room(), 300, 0)
    assert not _receive(sender, receiver, [text_only])[text_only.seed].lent
    receiver.release(second.seed)
    large = spec(new_room(), 3100, 3000)  # 25 blocks: more than the lent share (24)
    got = _receive(sender, receiver, [large])[large.seed]
    assert got.num_transfers >= 2 and not got.lent
    assert not _rows_in_buffer(receiver, got)
    assert receiver.stats()["num_used_blocks"] == 0  # copied rooms free their blocks at once
    for s in (scattered, text_only, large):
        receiver.release(s.seed)  # a no-op for copied rooms
    assert_no_leaks(sender, receiver)


def test_lending_stays_within_its_share_of_the_buffer(sender, make_receiver) -> None:
    # 32 blocks, half may be lent, and a default allocation (8) must stay free: two rooms of
    # 8 blocks are lent, the third is copied.
    receiver = make_receiver(num_blocks=32, default_tokens=1024)
    specs = [spec(new_room(), 1000, 900) for _ in range(3)]
    results: dict[int, ReceivedEmbeddings] = {}
    for s in specs:  # one at a time, so which room is lent is deterministic
        results.update(_receive(sender, receiver, [s]))
    assert [results[s.seed].lent for s in specs] == [True, True, False]
    assert receiver.stats()["num_lent_blocks"] == 16
    receiver.release(specs[0].seed)
    extra = spec(new_room(), 1000, 900)
    assert _receive(sender, receiver, [extra])[extra.seed].lent  # room again after a release
    for s in [*specs, extra]:
        receiver.release(s.seed)
    assert_no_leaks(sender, receiver)


def test_lending_off_always_copies(sender, make_receiver) -> None:
    receiver = make_receiver(num_blocks=32, default_tokens=1024, max_lent_fraction=0.0)
    s = spec(new_room(), 900, 900)
    got = _receive(sender, receiver, [s])[s.seed]
    assert not got.lent and receiver.stats()["num_used_blocks"] == 0
    receiver.release(s.seed)
    assert_no_leaks(sender, receiver)


def test_abort_and_close_free_lent_blocks(sender, make_receiver) -> None:
    receiver = make_receiver(num_blocks=32, default_tokens=1024)
    first, second = spec(new_room(), 500, 500), spec(new_room(), 500, 500)
    results = _receive(sender, receiver, [first, second])
    assert results[first.seed].lent and results[second.seed].lent
    receiver.abort(first.seed)  # the consumer gave up on a delivered room
    assert receiver.stats()["num_lent_blocks"] == 4
    receiver.close()  # what is still lent goes with the receiver
    assert receiver.stats()["num_lent_blocks"] == 0
    assert receiver.stats()["num_used_blocks"] == 0


def test_room_that_cannot_extend_falls_back_to_copies(sender, make_receiver) -> None:
    # 32 blocks of which 8 are lent and 12 wait for data that never comes: a 2000-token room
    # could be lent by its share, but the 12 blocks it would extend by are not free.
    receiver = make_receiver(num_blocks=32, default_tokens=512, max_lent_fraction=1.0)
    lent = spec(new_room(), 1000, 1000)
    assert _receive(sender, receiver, [lent])[lent.seed].lent
    waiting = [new_room() for _ in range(3)]
    for room in waiting:
        receiver.add_room(room, sender.endpoint)  # 4 blocks each, no data submitted
    s = spec(new_room(), 2000, 1500)
    got = _receive(sender, receiver, [s])[s.seed]
    assert got.num_transfers == 2 and not got.lent
    for room in [lent.seed, s.seed, *waiting]:
        receiver.abort(room)
    assert_no_leaks(sender, receiver)
