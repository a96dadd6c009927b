"""Encoder side of the transfer plane: holds each request's data until its receiver pulls it.

Room flow (sender view)::

    submit() --+-- init already there --> write chunk --> TRANSFERRING --(init)--> ... SUCCESS
               +-- no init yet: BOOTSTRAPPING (bootstrap_timeout_s)
    init ------+-- no data yet: WAITING_FOR_INPUT (bootstrap_timeout_s)

Writes run on a small pool of writer threads, so a slow receiver never blocks ``submit`` or the
control loop. Writes to one receiver go one at a time, in order (parallel writes to one peer
only contend for the same link: four at once ran at 0.6x the throughput of one after another);
different receivers are written in parallel. Our blocks are freed only when no write job owns
the room. A continuation init may arrive while the previous chunk is still being written (the
receiver asks for the rest as soon as it learns the size); it is served when that write
returns. Otherwise the room waits ``waiting_timeout_s`` for it after a chunk; a write (queued
or running) past ``transfer_timeout_s`` fails the room (the receiver is told a write may still
be in flight).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from protos.epd.v1 import transfer_pb2

from . import aux_record, chunks
from .config import TransferConfig
from .endpoint import TransferEndpoint
from .layout import BufferLayout
from .sender_room import SenderRoom, image_row_prefix
from .shm_transport import ShmTransport
from .transport import BaseTransport
from .types import AuxInfo, RoomState, TransferWriteError

logger = logging.getLogger(__name__)

MAX_FINISHED_ROOMS = 100_000


class EmbeddingSender(TransferEndpoint):
    def __init__(self, config: TransferConfig, layout: BufferLayout) -> None:
        self._rooms: dict[int, SenderRoom] = {}
        self._finished: collections.OrderedDict[int, RoomState] = collections.OrderedDict()
        self._failed_by_reason: collections.Counter[str] = collections.Counter()
        self.bytes_sent = 0
        self.num_transfers = 0
        self.write_seconds = 0.0  # time spent inside transport writes (successful chunks)
        # Observer of each successful chunk write: (bytes, seconds). Set by the metrics.
        self.on_write: Callable[[int, float], None] | None = None
        self._writes_by_transport: collections.Counter[str] = collections.Counter()
        self._next_shm_sweep = 0.0
        self._writers = ThreadPoolExecutor(config.num_writers, thread_name_prefix="epd-writer")
        # receiver endpoint -> writes waiting for the one in progress to that receiver
        self._write_queues: dict[str, collections.deque] = {}
        super().__init__(config, layout, shared=False)

    # ---- public API -------------------------------------------------------------------------

    def submit(
        self,
        room: int,
        fill_ids: np.ndarray,
        positions: np.ndarray,
        image_rows: torch.Tensor,
        aux: AuxInfo,
        image_mask: np.ndarray | None = None,
    ) -> bool:
        """Data for ``room`` is ready; False (nothing kept) when blocks are short.

        ``image_mask`` (bool ``[total_tokens]``) marks the image tokens, whose rows are
        ``image_rows`` in token order; it may be omitted when every token is an image token.
        """
        total = aux.total_tokens
        fill_ids, positions = np.asarray(fill_ids), np.asarray(positions)  # torch CPU ok too
        mask = self._check_inputs(fill_ids, positions, image_rows, aux, image_mask)
        with self._lock:
            if room in self._finished:
                return True  # failed or aborted before the data was ready: dropped
            existing = self._rooms.get(room)
            if existing is not None and existing.has_data:
                raise ValueError(f"room {room} was already submitted")
            allocation = self.allocator.alloc(total)
            if allocation is None:
                return False
        self.buffers.write_tokens(allocation.block_ids, fill_ids, positions, image_rows)
        with self._lock:
            state = self._rooms.get(room)
            if state is None and room in self._finished:  # failed meanwhile
                self.allocator.free(allocation)
                return True
            if state is None:
                state = SenderRoom(
                    room, deadline=time.monotonic() + self.config.bootstrap_timeout_s
                )
                self._rooms[room] = state
            state.allocation, state.aux, state.row_prefix = allocation, aux, image_row_prefix(mask)
            self._maybe_write(state)
        return True

    def fail(self, room: int, reason: str) -> None:
        """Encoding failed: the receiver gets FAILED with ``reason``."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                if room not in self._finished:
                    self._remember(room, RoomState.FAILED)
                    self._failed_by_reason["encode_failed"] += 1
                return
            self._fail(state, f"encode_failed: {reason}")

    def poll(self, room: int) -> RoomState:
        """The room's state; KeyError for a room this sender never heard of."""
        with self._lock:
            if room in self._rooms:
                return self._rooms[room].state
            return self._finished[room]

    def stats(self) -> dict:
        with self._lock:
            return {
                **self._common_stats(),
                "bytes_sent": self.bytes_sent,
                "num_transfers": self.num_transfers,
                "write_seconds": self.write_seconds,
                "writes_by_transport": dict(self._writes_by_transport),
                "failed_by_reason": dict(self._failed_by_reason),
                "messages": dict(self.counters),
            }

    def close(self) -> None:
        self._close_endpoint()
        self._writers.shutdown(wait=True, cancel_futures=True)

    # ---- internals --------------------------------------------------------------------------

    def _check_inputs(
        self,
        fill_ids: np.ndarray,
        positions: np.ndarray,
        image_rows: torch.Tensor,
        aux: AuxInfo,
        image_mask: np.ndarray | None,
    ) -> np.ndarray:
        """Validate a submit; returns the image-token mask."""
        total = aux.total_tokens
        if fill_ids.shape != (total,) or positions.shape != (3, total):
            raise ValueError(
                f"fill_ids {fill_ids.shape} / positions {positions.shape} do not match "
                f"total_tokens {total}"
            )
        expected = (aux.num_image_rows, self.layout.row_width)
        # Rows may come in any float dtype (the encoder's compute dtype): they are cast to the
        # layout's wire dtype as they are written into the blocks.
        if tuple(image_rows.shape) != expected or not image_rows.dtype.is_floating_point:
            raise ValueError(
                f"image_rows {tuple(image_rows.shape)} {image_rows.dtype}, expected {expected} "
                "of a float dtype"
            )
        if image_mask is None:
            if aux.num_image_rows != total:
                raise ValueError("image_mask is required unless every token is an image token")
            return np.ones(total, dtype=bool)
        mask = np.asarray(image_mask, dtype=bool)
        if mask.shape != (total,) or int(mask.sum()) != aux.num_image_rows:
            raise ValueError("image_mask must have total_tokens entries, num_image_rows set")
        return mask

    def _remember(self, room: int, state: RoomState) -> None:
        self._finished[room] = state
        while len(self._finished) > MAX_FINISHED_ROOMS:
            self._finished.popitem(last=False)

    def _status(self, state: SenderRoom, rstate: RoomState, **fields) -> None:
        if not state.receiver_endpoint:
            return
        msg = self._envelope()
        msg.status.room = state.room
        msg.status.state = int(rstate)
        for key, value in fields.items():
            setattr(msg.status, key, value)
        self._send(state.receiver_endpoint, msg)

    def _finish(self, state: SenderRoom) -> None:
        """Release a final room whose blocks no write owns any more."""
        if state.allocation is not None:
            self.allocator.free(state.allocation)
            state.allocation = None
        self._rooms.pop(state.room, None)
        self._remember(state.room, state.state)

    def _fail(self, state: SenderRoom, reason: str) -> None:
        if not state.fail(reason):
            return
        self._failed_by_reason[reason.split(":")[0]] += 1
        logger.info("room %d failed: %s", state.room, reason)
        self._status(state, RoomState.FAILED, error=reason, write_in_flight=state.writing)
        if state.writing:
            state.ack_pending = True  # the writer frees the blocks and acknowledges
        else:
            self._finish(state)

    def _maybe_write(self, state: SenderRoom) -> None:
        if state.writing or not state.has_data or state.init is None or state.state.is_final:
            return
        init = state.init
        if init.sent_tokens != state.sent_tokens:
            self._fail(state, f"bad_init: sent_tokens {init.sent_tokens} != {state.sent_tokens}")
            return
        problem = chunks.check_init(init, self.layout)
        if not problem and init.num_tokens_allocated <= 0:
            problem = "bad_init: no tokens allocated"
        if problem:
            self._fail(state, problem)
            return
        state.init = None
        state.writing = True
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
        queue = self._write_queues.get(state.receiver_endpoint)
        if queue is not None:  # a write to this receiver is running: go after it
            queue.append((state, init))
            return
        self._write_queues[state.receiver_endpoint] = collections.deque([(state, init)])
        self._writers.submit(self._drain, state.receiver_endpoint)

    def _drain(self, endpoint: str) -> None:
        """Writer thread: the queued writes to one receiver, in order, until none is left."""
        while True:
            with self._lock:
                queue = self._write_queues[endpoint]
                if not queue:
                    del self._write_queues[endpoint]
                    return
                state, init = queue.popleft()
            self._guarded_write(state, init)

    def _transport_for(self, init: transfer_pb2.TransferInit) -> tuple[BaseTransport | None, str]:
        """shm when the receiver shares our host and offers shm regions, else Mooncake."""
        if self.shm is not None and init.host_id == self.host_id and init.rows.shm_name:
            regions = [(r.shm_name, r.base, r.nbytes) for r in self._regions_of(init)]
            return self.shm, ShmTransport.session_for(regions)
        if self.mooncake is not None and init.mooncake_session:
            return self.mooncake, init.mooncake_session
        return None, ""

    @staticmethod
    def _regions_of(init: transfer_pb2.TransferInit) -> list[transfer_pb2.BufferRegion]:
        return [init.rows, init.fill_ids, init.positions, init.aux]

    def _guarded_write(self, state: SenderRoom, init: transfer_pb2.TransferInit) -> None:
        try:
            self._write_chunk(state, init)
        except Exception as exc:  # a bug must fail the room, not leave it owned forever
            logger.exception("write job for room %d crashed", state.room)
            with self._lock:
                state.writing = False
                self._fail(state, f"internal_error: {exc!r}")
                if state.state.is_final and state.room in self._rooms:
                    self._finish(state)

    def _write_chunk(self, state: SenderRoom, init: transfer_pb2.TransferInit) -> None:
        """Writer thread: one chunk = one batched write of every field, then the status."""
        assert state.allocation is not None and state.aux is not None
        with self._lock:
            if state.state.is_final:  # failed or aborted while queued: nothing was written
                self._end_write(state)
                return
        chunk = chunks.plan_chunk(state.row_prefix, state.sent_tokens, init.num_tokens_allocated)
        record = aux_record.pack(state.room, state.aux, chunk)
        error = ""
        nbytes = 0
        write_s = 0.0
        transport_name = ""
        try:
            transport, session = self._transport_for(init)
            if transport is None:
                raise TransferWriteError("no_transport: no transport in common with the receiver")
            self.buffers.set_aux(state.allocation.block_ids[0], record)
            rows_at = chunks.dest_row_offset(state.row_prefix, init)
            segments = chunks.build_segments(
                self.buffers, state.allocation.block_ids, init, chunk, rows_at, len(record)
            )
            start = time.perf_counter()
            transport.write(session, *segments)
            write_s = time.perf_counter() - start
            transport_name = transport.name
            nbytes = sum(segments.lengths)
        except (TransferWriteError, ValueError, OSError) as exc:
            error = str(exc) if str(exc).startswith("no_transport") else f"write_failed: {exc}"
        with self._lock:
            if state.state.is_final:  # failed or aborted while writing: now it is safe
                self._end_write(state)
                return
            state.writing = False
            if error:
                self._fail(state, error)
                return
            self.bytes_sent += nbytes
            self.write_seconds += write_s
            if self.on_write is not None:
                self.on_write(nbytes, write_s)
            self._writes_by_transport[transport_name] += 1
            self.num_transfers += 1
            state.num_transfers += 1
            state.sent_tokens += chunk.num_tokens
            done = state.sent_tokens == state.aux.total_tokens
            rstate = RoomState.SUCCESS if done else RoomState.TRANSFERRING
            self._status(
                state,
                rstate,
                chunk_start=chunk.chunk_start,
                num_tokens=chunk.num_tokens,
                total_tokens=state.aux.total_tokens,
                write_s=write_s,
            )
            if done:
                state.move(RoomState.SUCCESS)
                self._finish(state)
            else:
                state.deadline = time.monotonic() + self.config.waiting_timeout_s
                self._maybe_write(state)  # a continuation init may already be here

    def _end_write(self, state: SenderRoom) -> None:
        """A failed room's write job is over: acknowledge (nothing in flight) and free."""
        state.writing = False
        if state.ack_pending:
            self._status(state, RoomState.FAILED, error=state.reason)
        self._finish(state)

    # ---- control loop -----------------------------------------------------------------------

    def _on_message(self, env: transfer_pb2.TransferEnvelope) -> None:
        kind = env.WhichOneof("body")
        if kind == "init":
            self._on_init(env.init)
        elif kind == "abort":
            state = self._rooms.get(env.abort.room)
            if state is None:
                self.counters["unknown_room"] += 1
                ack = SenderRoom(env.abort.room, receiver_endpoint=env.from_endpoint)
                self._status(ack, RoomState.FAILED, error="aborted")  # nothing in flight
                if env.abort.room not in self._finished:
                    self._remember(env.abort.room, RoomState.FAILED)
                return
            self._fail(state, f"aborted: {env.abort.reason}")
        elif kind != "heartbeat":
            self.counters["unexpected_message"] += 1

    def _on_init(self, init: transfer_pb2.TransferInit) -> None:
        now = time.monotonic()
        state = self._rooms.get(init.room)
        if state is None:
            finished = self._finished.get(init.room)
            if finished is not None:
                if finished == RoomState.FAILED:
                    ack = SenderRoom(init.room, receiver_endpoint=init.receiver_endpoint)
                    self._status(ack, RoomState.FAILED, error="failed before the init arrived")
                else:
                    self.counters["stale_init"] += 1
                return
            state = SenderRoom(init.room, deadline=now + self.config.bootstrap_timeout_s)
            state.move(RoomState.WAITING_FOR_INPUT)
            self._rooms[init.room] = state
        if state.init is not None or (state.writing and init.sent_tokens <= state.sent_tokens):
            self.counters["duplicate_init"] += 1
            return
        state.receiver_endpoint = init.receiver_endpoint
        self.peers.watch(init.receiver_endpoint, now)
        state.init = init
        self._maybe_write(state)

    def _on_tick(self, now: float) -> None:
        for state in list(self._rooms.values()):
            if state.state.is_final or now <= state.deadline:
                continue
            if state.writing:
                self._fail(state, "transfer_timeout: write did not finish")
            elif state.state == RoomState.TRANSFERRING:
                self._fail(state, "waiting_timeout: no continuation init")
            else:
                self._fail(state, "bootstrap_timeout: data and init did not meet")
        active = {
            s.receiver_endpoint
            for s in self._rooms.values()
            if s.receiver_endpoint and not s.state.is_final
        }
        if self.shm is not None and now >= self._next_shm_sweep:
            self._next_shm_sweep = now + self.config.heartbeat_interval_s
            self.shm.release_missing()  # receivers that closed unlinked their regions
        for ep in self.peers.silent(active, now):
            for state in list(self._rooms.values()):
                if state.receiver_endpoint == ep:
                    self._fail(state, f"receiver_dead: {ep} silent")
        self._send_heartbeats(active, now)
