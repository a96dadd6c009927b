"""The sender writes to one receiver one chunk at a time; a room failed while queued is never
written, its blocks are freed at once and its receiver is told that nothing is in flight.

Sender and receiver share this process (shared-memory transport) so that the test can hold the
first write open; every other part is the real one.
"""

from __future__ import annotations

import threading

from bench.synthetic import make_request, matches
from common.transfer.receiver import EmbeddingReceiver
from common.transfer.sender import EmbeddingSender
from common.transfer.types import ReceivedEmbeddings, RoomState, TransferError

from .conftest import layout_of, make_config, new_room, wait_for
from .helpers import collect, spec


class GatedWrites:
    """Wraps a transport's ``write``: the first call waits for ``gate``; counts concurrency."""

    def __init__(self, write) -> None:
        self._write = write
        self.gate = threading.Event()
        self.first_started = threading.Event()
        self._lock = threading.Lock()
        self.active = self.max_active = self.num_calls = 0

    def __call__(self, *args) -> None:
        with self._lock:
            self.num_calls += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            first = self.num_calls == 1
        if first:
            self.first_started.set()
            assert self.gate.wait(10.0)
        try:
            self._write(*args)
        finally:
            with self._lock:
                self.active -= 1


def test_one_write_at_a_time_and_queued_abort_is_never_written() -> None:
    config = make_config(num_blocks=64, transport="shm")
    sender = EmbeddingSender(config, layout_of(config))
    receiver = EmbeddingReceiver(config, layout_of(config))
    gated = GatedWrites(sender.shm.write)
    sender.shm.write = gated
    try:
        specs = [spec(new_room(), 600) for _ in range(3)]
        for s in specs:
            req = make_request(s, sender.layout)
            args = (req.fill_ids, req.positions, req.image_rows, req.aux, req.image_mask)
            assert sender.submit(s.seed, *args)
        for s in specs:
            receiver.add_room(s.seed, sender.endpoint)
        assert gated.first_started.wait(10.0)
        dropped = specs[1].seed
        assert wait_for(lambda: sender.poll(dropped) == RoomState.TRANSFERRING)
        receiver.abort(dropped)  # queued behind the held write
        assert wait_for(lambda: sender.poll(dropped) == RoomState.FAILED)
        # while the first write is still held: the queued room's blocks are free on the sender
        # (5 blocks per 600-token room) and the receiver got the all-clear for its quarantine
        assert wait_for(lambda: sender.stats()["num_used_blocks"] == 2 * 5)
        assert wait_for(lambda: receiver.stats()["num_quarantined_blocks"] == 0)
        assert not gated.gate.is_set() and gated.num_calls == 1
        gated.gate.set()
        kept = {specs[0].seed, specs[2].seed}
        results = collect(receiver, kept)
        for s in (specs[0], specs[2]):
            got = results[s.seed]
            assert isinstance(got, ReceivedEmbeddings) and not isinstance(got, TransferError)
            assert matches(got, make_request(s, receiver.layout))
            receiver.release(s.seed)
        assert gated.max_active == 1 and gated.num_calls == 2  # the aborted room: no write
        assert wait_for(lambda: receiver.stats()["num_used_blocks"] == 0)
        assert wait_for(lambda: sender.stats()["num_used_blocks"] == 0)
        assert sender.stats()["failed_by_reason"] == {"aborted": 1}
    finally:
        gated.gate.set()
        receiver.close()
        sender.close()
