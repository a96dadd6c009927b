"""Partial chunks (minor 4): the sender ships a room's tokens as their rows become ready.

Real Mooncake over tcp, sender in another process. The encoder begins a room with its tokens
and the rows it has, then adds rows image by image; each chunk but an init's last ends on a
destination block boundary, the receiver reports each landed chunk (``ReceivedChunk``) before
the room's outcome, and every byte of the assembled room equals what was sent.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from bench.peer import Peer
from bench.synthetic import make_request, matches
from common.transfer.types import ReceivedChunk, ReceivedEmbeddings, TransferError

from .conftest import assert_no_leaks, layout_of, make_config, new_room, wait_for
from .helpers import sender_state, spec

BLOCK = 128


def _events(receiver, room: int, until_final: bool = True, timeout_s: float = 20.0) -> list:
    """What ``pop_done`` reported for ``room``, in order (until its outcome, or one event)."""
    events: list = []
    done = False

    def poll() -> bool:
        nonlocal done
        for got_room, outcome in receiver.pop_done(timeout_s=0.05):
            assert got_room == room
            events.append(outcome)
            done = done or not isinstance(outcome, ReceivedChunk)
        return done if until_final else bool(events)

    assert wait_for(poll, timeout_s), events
    return events


def _check_prefix(chunks: list[ReceivedChunk], expected) -> int:
    """The reported chunks are the request's first tokens, in order; their count."""
    at = rows_at = 0
    for chunk in chunks:
        n = len(chunk.fill_ids)
        assert chunk.start == at
        assert np.array_equal(chunk.fill_ids, expected.fill_ids[at : at + n])
        assert np.array_equal(chunk.positions, expected.positions[:, at : at + n])
        k = int(expected.image_mask[at : at + n].sum())
        assert torch.equal(chunk.image_rows, expected.image_rows[rows_at : rows_at + k])
        assert chunk.aux.total_tokens == expected.aux.total_tokens
        at, rows_at = at + n, rows_at + k
    return at


def test_rows_ship_as_they_come(sender, make_receiver) -> None:
    """A 900-token room (one 600-row image) fits the default allocation: begun with no rows,
    its text prefix goes at once (whole blocks), then each piece of rows brings a chunk."""
    receiver = make_receiver(num_blocks=32, default_tokens=1024, report_progress=True)
    s = spec(new_room(), 900, 600)
    expected = make_request(s, receiver.layout)
    first_image_token = int(np.argmax(expected.image_mask))
    receiver.add_room(s.seed, sender.endpoint)
    assert sender.ask("begin", s, 0)
    pieces = [(0, 250), (250, 500), (500, 600)]
    reported: list[ReceivedChunk] = []
    for lo, hi in pieces:
        if first_image_token >= BLOCK or lo:  # something to ship before this piece
            reported += _events(receiver, s.seed, until_final=False)
        sender.ask("add_rows", s, lo, hi)
    events = _events(receiver, s.seed)
    reported += [e for e in events if isinstance(e, ReceivedChunk)]
    final = events[-1]
    assert isinstance(final, ReceivedEmbeddings), final
    assert matches(final, expected)
    assert final.num_transfers == len(reported) + 1 >= 3
    covered = _check_prefix(reported, expected)
    assert covered % BLOCK == 0 and covered < 900  # every partial chunk ended on a block
    assert final.lent  # still one run of blocks: delivered without a copy
    receiver.release(s.seed)
    assert_no_leaks(sender, receiver)


def test_partial_chunks_then_a_continuation(sender, make_receiver) -> None:
    """2000 tokens with a 1024-token first allocation: partial chunks fill the first init,
    the continuation (asked for at the announcement) takes the rest."""
    receiver = make_receiver(num_blocks=32, default_tokens=1024, report_progress=True)
    s = spec(new_room(), 2000, 1800)
    expected = make_request(s, receiver.layout)
    receiver.add_room(s.seed, sender.endpoint)
    assert sender.ask("begin", s, 300)
    events = _events(receiver, s.seed, until_final=False)  # what the first rows make ready
    for lo in range(300, 1800, 500):
        sender.ask("add_rows", s, lo, min(lo + 500, 1800))
    events += _events(receiver, s.seed)
    final = events[-1]
    assert isinstance(final, ReceivedEmbeddings) and matches(final, expected)
    chunks = [e for e in events if isinstance(e, ReceivedChunk)]
    assert _check_prefix(chunks, expected) < 2000
    assert receiver.stats()["messages"].get("continuation_ahead") == 1
    receiver.release(s.seed)
    assert_no_leaks(sender, receiver)


def test_receiver_without_progress_gets_the_room_alone(sender, make_receiver) -> None:
    receiver = make_receiver(num_blocks=32, default_tokens=512)
    s = spec(new_room(), 1500, 1200)
    receiver.add_room(s.seed, sender.endpoint)
    assert sender.ask("begin", s, 100)
    for lo in (100, 700):
        sender.ask("add_rows", s, lo, lo + 600 if lo == 100 else 1200)
    events = _events(receiver, s.seed)
    assert len(events) == 1 and matches(events[0], make_request(s, receiver.layout))
    assert events[0].num_transfers >= 2  # more when the rows came between writes
    receiver.release(s.seed)
    assert_no_leaks(sender, receiver)


def test_receiver_waits_while_the_rows_are_encoded(sender, make_receiver) -> None:
    """Between two images the sender holds the init and says so (a mid-room acknowledgement):
    the receiver waits past its write timeout for the rest, then gets it."""
    receiver = make_receiver(num_blocks=32, default_tokens=1024, report_progress=True)
    s = spec(new_room(), 900, 600)
    receiver.add_room(s.seed, sender.endpoint)
    sender.ask("call", "expect", s.seed, time.monotonic() + 30.0)
    assert sender.ask("begin", s, 300)
    _events(receiver, s.seed, until_final=False)
    # longer than transfer_timeout_s + heartbeat_timeout_s (3 s in these tests): without the
    # sender's word that it holds the init the room would time out waiting for the write
    assert wait_for(lambda: receiver.stats()["messages"].get("acknowledged_inits", 0) >= 1)
    assert not wait_for(lambda: receiver.stats()["rooms_finished"].get("FAILED", 0) > 0, 4.0)
    sender.ask("add_rows", s, 300, 600)
    events = _events(receiver, s.seed)
    assert isinstance(events[-1], ReceivedEmbeddings)
    receiver.release(s.seed)
    assert_no_leaks(sender, receiver)


def test_abort_between_images_frees_both_sides(sender, make_receiver) -> None:
    receiver = make_receiver(num_blocks=32, default_tokens=1024, report_progress=True)
    s = spec(new_room(), 900, 600)
    receiver.add_room(s.seed, sender.endpoint)
    assert sender.ask("begin", s, 300)
    _events(receiver, s.seed, until_final=False)
    receiver.abort(s.seed)
    assert wait_for(lambda: sender_state(sender, s.seed) is not None)
    sender.ask("add_rows", s, 300, 600)  # late rows of a failed room are dropped
    assert receiver.pop_done() == []
    assert_no_leaks(sender, receiver)


def test_sender_killed_between_images(make_receiver) -> None:
    config = make_config(num_blocks=64)
    doomed = Peer("sender", config, layout_of(config))
    receiver = make_receiver(num_blocks=32, default_tokens=1024, report_progress=True)
    try:
        s = spec(new_room(), 900, 600)
        receiver.add_room(s.seed, doomed.endpoint)
        assert doomed.ask("begin", s, 300)
        _events(receiver, s.seed, until_final=False)
        doomed.kill()
        events = _events(receiver, s.seed, timeout_s=15.0)
        assert isinstance(events[-1], TransferError)
        assert events[-1].reason.split(":")[0] in {"sender_dead", "timeout"}
        assert wait_for(lambda: receiver.stats()["num_used_blocks"] == 0, 10.0)
    finally:
        doomed.close()
