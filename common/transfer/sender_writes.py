"""The write half of the sender: one queue of chunk writes per receiver, served by writer threads.

Writes run on a small pool of writer threads, so a slow receiver never blocks ``submit`` or the
control loop. Writes to one receiver go one at a time, in order (parallel writes to one peer
only contend for the same link: four at once ran at 0.6x the throughput of one after another);
different receivers are written in parallel.

A room's blocks are read by a write only after its job left the queue (``write_started``): a
room failed while its job still waits is taken out of the queue and freed at once; one failed
during its write is freed, and the receiver told that nothing is in flight any more, when the
write returns. ``EmbeddingSender`` (``sender.py``) holds the room flow and the control loop.
"""

from __future__ import annotations

import collections
import logging
import time
from abc import abstractmethod

from protos.epd.v1 import transfer_pb2

from . import aux_record, chunks
from .aux_record import ChunkInfo
from .destinations import check_init
from .endpoint import TransferEndpoint
from .sender_room import SenderRoom
from .shm_transport import ShmTransport
from .transport import BaseTransport
from .types import BadDestinationError, FailureKind, RoomState, TransferWriteError

logger = logging.getLogger(__name__)


class SenderWrites(TransferEndpoint):
    """Chunk writes of an ``EmbeddingSender``; every method but the writer's runs locked."""

    def _init_writes(self) -> None:
        self.bytes_sent = 0
        self.num_transfers = 0
        self.write_seconds = 0.0  # time spent inside transport writes (successful chunks)
        self._writes_by_transport: collections.Counter[str] = collections.Counter()
        # receiver endpoint -> writes waiting for the one in progress to that receiver
        self._write_queues: dict[str, collections.deque] = {}

    @abstractmethod
    def _fail(self, state: SenderRoom, kind: FailureKind, detail: str) -> None:
        """Fail the room, tell its receiver; frees it unless a write is in flight."""

    @abstractmethod
    def _finish(self, state: SenderRoom) -> None:
        """Release a final room whose blocks no write owns any more."""

    @abstractmethod
    def _arm(self, state: SenderRoom, now: float) -> None:
        """Set the bound of the state a room waits in (not while a write job owns it)."""

    @abstractmethod
    def _status(self, state: SenderRoom, rstate: RoomState, **fields) -> None:
        """Send the room's receiver a status."""

    @abstractmethod
    def _ack(self, state: SenderRoom, now: float) -> None:
        """Tell the receiver its init is held for the data, and for how long."""

    def _maybe_write(self, state: SenderRoom) -> None:
        """Queue the room's next chunk when an init is held and some of its data is ready."""
        if state.writing or not state.has_data or state.state.is_final:
            return
        if state.init is None:  # the last init was filled: serve the continuation, if here
            state.init, state.next_init, state.init_written = state.next_init, None, 0
        init = state.init
        if init is None:
            return
        if state.init_written == 0:
            if init.sent_tokens != state.sent_tokens:
                detail = f"sent_tokens {init.sent_tokens} != {state.sent_tokens}"
                self._fail(state, FailureKind.BAD_INIT, detail)
                return
            problem = check_init(init, self.layout)
            if problem is not None:
                self._fail(state, *problem)
                return
        chunk = self._next_chunk(state, init)
        if chunk is None:
            self._hold(state, init)
            return
        state.writing, state.write_started = True, False
        if state.sent_tokens == 0 and state.aux.total_tokens > init.num_tokens_allocated:
            # a continuation will follow: announce the size so the receiver prepares meanwhile
            self._status(
                state,
                RoomState.TRANSFERRING,
                total_tokens=state.aux.total_tokens,
                num_image_rows=state.aux.num_image_rows,
                write_in_flight=True,
            )
        state.move(RoomState.TRANSFERRING)
        state.deadline = time.monotonic() + self.config.transfer_timeout_s
        job = (state, init, chunk, init.dest_token_offset + state.init_written)
        queue = self._write_queues.get(state.receiver_endpoint)
        if queue is not None:  # a write to this receiver is running: go after it
            queue.append(job)
            return
        self._write_queues[state.receiver_endpoint] = collections.deque([job])
        self._writers.submit(self._drain, state.receiver_endpoint)

    @staticmethod
    def _next_chunk(state: SenderRoom, init: transfer_pb2.TransferInit) -> ChunkInfo | None:
        """The tokens the next write carries into ``init``: up to its capacity or the end of
        the request, or, when the rows stop short of that and the receiver accepts partial
        chunks, up to the last whole destination block they fill; None when nothing can go."""
        start = state.sent_tokens
        end = min(state.aux.total_tokens, start + init.num_tokens_allocated - state.init_written)
        ready = state.ready_tokens
        if ready < end:
            if not init.accepts_partial:
                return None
            dest_slot = init.dest_token_offset + state.init_written + (ready - start)
            end = chunks.partial_end(ready, dest_slot, init.block_size)
        if end <= start:
            return None
        return chunks.plan_chunk(state.row_prefix, start, end - start)

    def _hold(self, state: SenderRoom, init: transfer_pb2.TransferInit) -> None:
        """An init is held while the rows its next chunk needs are still being encoded: tell
        the receiver (once per position) how long it is held, so it waits for the data rather
        than for a write. Mid-room only to a receiver that takes partial chunks."""
        if state.held_at == state.sent_tokens or (state.sent_tokens and not init.accepts_partial):
            return
        state.held_at = state.sent_tokens
        state.move(RoomState.WAITING_FOR_INPUT)
        now = time.monotonic()
        self._arm(state, now)
        self._ack(state, now)

    def _dequeue(self, state: SenderRoom) -> None:
        """Take the room's job out of its queue (it has not started): its blocks are free."""
        queue = self._write_queues.get(state.receiver_endpoint)
        if queue is not None:  # by identity: rooms do not compare by value
            kept = [job for job in queue if job[0] is not state]
            queue.clear()
            queue.extend(kept)
        state.writing = False

    def _drain(self, endpoint: str) -> None:
        """Writer thread: the queued writes to one receiver, in order, until none is left."""
        while True:
            with self._lock:
                queue = self._write_queues[endpoint]
                if not queue:
                    del self._write_queues[endpoint]
                    return
                state, init, chunk, tokens_at = queue.popleft()
                state.write_started = True
            self._guarded_write(state, init, chunk, tokens_at)

    def _transport_for(self, init: transfer_pb2.TransferInit) -> tuple[BaseTransport | None, str]:
        """shm when the receiver shares our host and offers shm regions, else Mooncake."""
        if self.shm is not None and init.host_id == self.host_id and init.rows.shm_name:
            regions = [(r.shm_name, r.base, r.nbytes) for r in _regions_of(init)]
            return self.shm, ShmTransport.session_for(regions)
        if self.mooncake is not None and init.mooncake_session:
            return self.mooncake, init.mooncake_session
        return None, ""

    def _guarded_write(
        self, state: SenderRoom, init: transfer_pb2.TransferInit, chunk: ChunkInfo, tokens_at: int
    ) -> None:
        try:
            self._write_chunk(state, init, chunk, tokens_at)
        except Exception as exc:  # a bug must fail the room, not leave it owned forever
            logger.exception("write job for room %d crashed", state.room)
            with self._lock:
                state.writing = False
                self._fail(state, FailureKind.INTERNAL, repr(exc))
                if state.state.is_final and state.room in self._rooms:
                    self._finish(state)

    def _write_chunk(
        self, state: SenderRoom, init: transfer_pb2.TransferInit, chunk: ChunkInfo, tokens_at: int
    ) -> None:
        """Writer thread: one chunk = one batched write of every field, then the status. The
        chunk's tokens land at token slot ``tokens_at`` of the init's blocks. Over a transport
        that pays per segment, a small chunk's token fields and aux record ride in the status
        instead (``chunks.inline_tokens``; the receiver stores them at the same slots)."""
        assert state.allocation is not None and state.aux is not None
        with self._lock:
            if state.state.is_final:  # failed or aborted while queued: nothing was written
                self._end_write(state)
                return
            record = aux_record.pack(state.room, state.aux, chunk)
        failure: tuple[FailureKind, str] | None = None
        nbytes = 0
        write_s = 0.0
        transport_name = ""
        inline: dict[str, bytes] = {}  # the status's inline fields (minor 6)
        try:
            transport, session = self._transport_for(init)
            if transport is None:
                raise LookupError("no transport in common with the receiver")
            block_ids = state.allocation.block_ids
            rows_only = transport.costly_segments and chunks.inline_tokens(init, chunk)
            if rows_only:
                fill, pos = self.buffers.token_bytes(block_ids, chunk.chunk_start, chunk.num_tokens)
                inline = {"inline_fill_ids": fill, "inline_positions": pos, "inline_aux": record}
            else:  # the aux source slot is ours alone: one write of the room runs at a time
                self.buffers.set_aux(block_ids[0], record)
            rows_at = chunks.dest_row_offset(state.row_prefix, init, chunk.chunk_start)
            segments = chunks.build_segments(
                self.buffers, block_ids, init, chunk, rows_at, len(record), tokens_at, rows_only
            )
            start = time.perf_counter()
            if segments.lengths:  # none: a chunk without image rows, its fields inline
                transport.write(session, *segments)
            write_s = time.perf_counter() - start
            transport_name = transport.name
            nbytes = sum(segments.lengths) + sum(len(field) for field in inline.values())
        except LookupError as exc:
            failure = FailureKind.NO_TRANSPORT, str(exc)
        except BadDestinationError as exc:
            failure = FailureKind.BAD_INIT, str(exc)
        except (TransferWriteError, ValueError, OSError) as exc:
            failure = FailureKind.WRITE_FAILED, str(exc)
        with self._lock:
            if state.state.is_final:  # failed or aborted while writing: now it is safe
                self._end_write(state)
                return
            state.writing = state.write_started = False
            if failure is not None:
                self._fail(state, *failure)
                return
            self.bytes_sent += nbytes
            self.write_seconds += write_s
            if self.on_write is not None:
                self.on_write(nbytes, write_s)
            self._writes_by_transport[transport_name] += 1
            self.num_transfers += 1
            state.num_transfers += 1
            state.sent_tokens += chunk.num_tokens
            state.init_written += chunk.num_tokens
            done = state.sent_tokens == state.aux.total_tokens
            partial = not done and state.init_written < init.num_tokens_allocated
            rstate = RoomState.SUCCESS if done else RoomState.TRANSFERRING
            self._status(
                state,
                rstate,
                chunk_start=chunk.chunk_start,
                num_tokens=chunk.num_tokens,
                total_tokens=state.aux.total_tokens,
                write_s=write_s,
                partial=partial,
                **inline,
            )
            if done:
                state.move(RoomState.SUCCESS)
                self._finish(state)
            else:
                if not partial:  # the init is filled: now waiting for the continuation init
                    state.init, state.init_written = None, 0
                self._arm(state, time.monotonic())
                self._maybe_write(state)  # more rows, or the continuation, may already be here
        self._wake()  # a new bound, or a peer left without rooms

    def _end_write(self, state: SenderRoom) -> None:
        """A failed room's write job is over: acknowledge (nothing in flight) and free."""
        state.writing = state.write_started = False
        if state.ack_pending:
            self._status(state, RoomState.FAILED, error=state.reason, error_kind=int(state.kind))
        self._finish(state)


def _regions_of(init: transfer_pb2.TransferInit) -> list[transfer_pb2.BufferRegion]:
    return [init.rows, init.fill_ids, init.positions, init.aux]
