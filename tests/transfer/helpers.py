"""Driving one in-process receiver against a sender peer and checking every byte."""

from __future__ import annotations

import time

from bench.peer import Peer
from bench.synthetic import RequestSpec, make_request, matches
from common.transfer.receiver import EmbeddingReceiver
from common.transfer.types import ReceivedEmbeddings, RoomState, TransferError


def spec(room: int, total_tokens: int, num_image_rows: int | None = None) -> RequestSpec:
    rows = total_tokens // 2 if num_image_rows is None else num_image_rows
    return RequestSpec(seed=room, total_tokens=total_tokens, num_image_rows=rows)


def collect(
    receiver: EmbeddingReceiver, rooms: set[int], timeout_s: float = 20.0
) -> dict[int, ReceivedEmbeddings | TransferError]:
    results: dict[int, ReceivedEmbeddings | TransferError] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(rooms) and time.monotonic() < deadline:
        for room, result in receiver.pop_done(timeout_s=0.1):
            assert room not in results, f"room {room} reported twice"
            results[room] = result
    assert set(results) == rooms, f"missing rooms {rooms - set(results)}"
    return results


def run_rooms(
    sender: Peer, receiver: EmbeddingReceiver, specs: list[RequestSpec], data_first: bool = True
) -> dict[int, ReceivedEmbeddings]:
    """Move every spec through the protocol; assert each arrives byte-exact."""
    if data_first:
        assert sender.ask("submit_all", specs)
    for s in specs:
        receiver.add_room(s.seed, sender.endpoint)
    if not data_first:
        assert sender.ask("submit_all", specs)
    results = collect(receiver, {s.seed for s in specs})
    for s in specs:
        got = results[s.seed]
        assert isinstance(got, ReceivedEmbeddings), got
        assert matches(got, make_request(s, receiver.layout)), f"room {s.seed} differs"
        receiver.release(s.seed)
    return results  # type: ignore[return-value]


def sender_state(sender: Peer, room: int) -> RoomState | None:
    """The sender's state of ``room``; None while it has not heard of it."""
    try:
        return RoomState(sender.ask("call", "poll", room))
    except RuntimeError:
        return None
