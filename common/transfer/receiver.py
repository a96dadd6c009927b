"""Language side of the transfer plane: pulls each room's embeddings in one or more chunks.

Room flow (receiver view)::

    add_room -> BOOTSTRAPPING (queued until default_tokens of blocks are free)
             -> WAITING_FOR_INPUT (init sent with sent_tokens = 0)
             -> TRANSFERRING (a chunk landed, more remains: either extend the room's blocks to
                              the whole request and ask for the rest behind what arrived, or
                              copy it out, free the blocks and alloc_up_to(rest); continuation
                              init with sent_tokens = received)
             -> SUCCESS (the whole request is assembled)   | FAILED from anywhere

Zero-copy delivery: a room whose chunks all landed in its blocks, rows in one run of slots, is
delivered as a view of them (``ReceivedEmbeddings.lent``); the blocks stay lent until the
consumer calls ``release(room)``. Lent blocks stay within ``config.max_lent_fraction`` of the
buffer and never take the space a new room's default allocation needs; a room that would not
fit that share (or whose sender predates ``dest_token_offset``) is copied out chunk by chunk.

Buffer priority: waiting continuations are served before any new room. Blocks into which a
write may still land (an init is out) are never freed on failure or abort: they go to
quarantine until the sender acknowledges (a FAILED status without ``write_in_flight``) or
``config.quarantine_s`` passes.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from protos.epd.v1 import transfer_pb2

from . import aux_record, chunks, messages
from .allocator import Allocation
from .config import TransferConfig
from .endpoint import TransferEndpoint
from .layout import BufferLayout
from .receiver_room import ReceiverRoom
from .transport import uses_shm
from .types import ReceivedEmbeddings, RoomState, TransferError

logger = logging.getLogger(__name__)

MAX_FINISHED_ROOMS = 100_000
Done = tuple[int, ReceivedEmbeddings | TransferError]


class EmbeddingReceiver(TransferEndpoint):
    def __init__(self, config: TransferConfig, layout: BufferLayout) -> None:
        self._rooms: dict[int, ReceiverRoom] = {}
        self._finished: collections.OrderedDict[int, RoomState] = collections.OrderedDict()
        self._done: list[Done] = []
        self._new_queue: collections.deque[int] = collections.deque()
        self._cont_queue: collections.deque[int] = collections.deque()
        self._quarantine: dict[int, list[tuple[Allocation, float]]] = {}
        self._lent: dict[int, Allocation] = {}  # delivered rooms whose rows are views of these
        self.num_rooms_lent = 0  # lifetime count of rooms delivered without a copy
        self._failed_by_reason: collections.Counter[str] = collections.Counter()
        self.bytes_received = 0
        self.num_transfers = 0
        # Observer of each completed room: its number of transfers. Set by the metrics.
        self.on_room_done: Callable[[int], None] | None = None
        # Called (lock held: it must not block) whenever a room's outcome becomes available to
        # pop_done, so a consumer can sleep until there is something to pop.
        self.on_done: Callable[[], None] | None = None
        super().__init__(config, layout, shared=uses_shm(config.transport))
        self._done_ready = threading.Condition(self._lock)  # no room exists before this
        self._init_template = self._make_init_template()

    # ---- public API -------------------------------------------------------------------------

    def add_room(self, room: int, sender_endpoint: str, deadline: float | None = None) -> None:
        """Start pulling ``room`` from the sender at ``sender_endpoint``; ``deadline``
        (``time.monotonic()`` clock) is the request's own: the room fails once it passes."""
        with self._lock:
            if room in self._rooms or room in self._finished:
                raise ValueError(f"room {room} already added")
            now = time.monotonic()
            state = ReceiverRoom(
                room, sender_endpoint, deadline=now + self.config.bootstrap_timeout_s
            )
            if deadline is not None:
                state.request_deadline = deadline
            self._rooms[room] = state
            self._new_queue.append(room)
            self._schedule()

    def poll(self, room: int) -> RoomState:
        """The room's state; KeyError for a room never added (or aborted)."""
        with self._lock:
            if room in self._rooms:
                return self._rooms[room].state
            return self._finished[room]

    def pop_done(self, timeout_s: float = 0.0) -> list[Done]:
        """Rooms that ended since the last call, each reported exactly once (aborts excluded).

        With ``timeout_s`` > 0, waits up to that long for at least one.
        """
        with self._lock:
            if not self._done and timeout_s > 0:
                self._done_ready.wait(timeout_s)
            done, self._done = self._done, []
            return done

    def release(self, room: int) -> None:
        """The consumer is done with delivered ``room``: blocks lent to it are free again.

        Call it once for every delivered room (a no-op for one whose data was copied out);
        a lent ``image_rows`` view must not be used afterwards.
        """
        with self._lock:
            allocation = self._lent.pop(room, None)
            if allocation is not None:
                self._free(allocation)

    def abort(self, room: int) -> None:
        """Drop ``room`` whatever its state; blocks a write may still hit stay quarantined."""
        with self._lock:
            state = self._rooms.get(room)
            if state is not None:
                self._fail(state, "aborted: by the receiver", report=False)
            self._done = [d for d in self._done if d[0] != room]
            self._finished.pop(room, None)
            self.release(room)

    def stats(self) -> dict:
        with self._lock:
            return {
                **self._common_stats(),
                "num_quarantined_blocks": sum(
                    len(a.block_ids) for q in self._quarantine.values() for a, _ in q
                ),
                "num_lent_blocks": self._num_lent_blocks(),
                "num_lent_rooms": len(self._lent),
                "num_rooms_lent": self.num_rooms_lent,
                "num_waiting_continuations": len(self._cont_queue),
                "num_waiting_rooms": len(self._new_queue),
                "bytes_received": self.bytes_received,
                "num_transfers": self.num_transfers,
                "failed_by_reason": dict(self._failed_by_reason),
                "messages": dict(self.counters),
            }

    def close(self) -> None:
        with self._lock:
            for state in list(self._rooms.values()):
                self._fail(state, "closed: receiver shut down", report=False)
            for room in list(self._lent):
                self.release(room)
        self._close_endpoint()

    # ---- buffers and inits ------------------------------------------------------------------

    def _make_init_template(self) -> transfer_pb2.TransferInit:
        regions = self.buffers.regions
        init = transfer_pb2.TransferInit(
            receiver_endpoint=self.endpoint,
            host_id=self.host_id,
            mooncake_session=self.mooncake.session_id if self.mooncake else "",
            **chunks.layout_fields(self.layout),
        )
        for name in ("rows", "fill_ids", "positions", "aux"):
            region = regions[name]
            getattr(init, name).CopyFrom(
                transfer_pb2.BufferRegion(
                    base=region.base, nbytes=region.nbytes, shm_name=region.shm_name
                )
            )
        return init

    def _send_init(
        self, state: ReceiverRoom, allocation: Allocation, sent_tokens: int | None = None
    ) -> None:
        """Ask for the room from ``sent_tokens`` (default: what has landed) into ``allocation``,
        behind the room's tokens from ``held_start`` that sit (or will sit) at its front."""
        now = time.monotonic()
        sent = state.received if sent_tokens is None else sent_tokens
        in_place = sent - state.held_start
        msg = self._envelope()
        msg.init.CopyFrom(self._init_template)
        msg.init.room = state.room
        state.allocation = allocation
        msg.init.block_ids.extend(allocation.block_ids)
        msg.init.num_tokens_allocated = allocation.num_tokens - in_place
        msg.init.sent_tokens = sent
        msg.init.dest_token_offset = in_place
        state.awaiting_write = state.init_sent = True
        if state.state == RoomState.BOOTSTRAPPING:
            state.move(RoomState.WAITING_FOR_INPUT)
            state.deadline = now + self.config.bootstrap_timeout_s + self.config.transfer_timeout_s
        else:
            state.deadline = now + self.config.transfer_timeout_s + self.config.heartbeat_timeout_s
        self.peers.watch(state.sender_endpoint, now)
        self._send(state.sender_endpoint, msg)

    def _schedule(self) -> None:
        """Hand free blocks out: continuations first (what is free), then new rooms (default)."""
        while self._cont_queue:
            state = self._rooms.get(self._cont_queue[0])
            if state is None or state.state.is_final:
                self._cont_queue.popleft()
                continue
            allocation = self.allocator.alloc_up_to(state.aux.total_tokens - state.received)
            if allocation is None:
                return
            self._cont_queue.popleft()
            self._send_init(state, allocation)
        while self._new_queue:
            state = self._rooms.get(self._new_queue[0])
            if state is None or state.state.is_final:
                self._new_queue.popleft()
                continue
            allocation = self.allocator.alloc(self.config.default_tokens)
            if allocation is None:
                return
            self._new_queue.popleft()
            self._send_init(state, allocation)

    def _num_lent_blocks(self) -> int:
        return sum(len(a.block_ids) for a in self._lent.values())

    def _may_lend(self, total_tokens: int) -> bool:
        """Whether a room of ``total_tokens`` may keep its blocks as its delivered rows: lent
        blocks stay within ``max_lent_fraction`` of the buffer and always leave room for one
        new room's default allocation, so lending never stalls new rooms for long."""
        num_blocks = self.layout.num_blocks
        num_lent = self._num_lent_blocks() + self.allocator.blocks_for(total_tokens)
        return (
            num_lent <= self.config.max_lent_fraction * num_blocks
            and num_blocks - num_lent >= self.config.default_blocks
        )

    def _free(self, allocation: Allocation) -> None:
        self.allocator.free(allocation)
        self._schedule()

    def _release(self, state: ReceiverRoom) -> None:
        """Give up the room's blocks: free, or quarantine while a write may still land."""
        allocation, state.allocation = state.allocation, None
        if allocation is None:
            return
        if state.awaiting_write:
            deadline = time.monotonic() + self.config.quarantine_s
            self._quarantine.setdefault(state.room, []).append((allocation, deadline))
        else:
            self._free(allocation)

    def _end(self, state: ReceiverRoom, outcome: ReceivedEmbeddings | TransferError | None) -> None:
        self._rooms.pop(state.room, None)
        if outcome is not None:
            self._finished[state.room] = state.state
            while len(self._finished) > MAX_FINISHED_ROOMS:
                self._finished.popitem(last=False)
            self._done.append((state.room, outcome))
            self._done_ready.notify_all()
            if self.on_done is not None:
                self.on_done()

    def _fail(self, state: ReceiverRoom, reason: str, report: bool = True) -> None:
        if state.state.is_final:
            return
        state.move(RoomState.FAILED)
        self._failed_by_reason[reason.split(":")[0]] += 1
        if state.init_sent:
            msg = self._envelope()
            msg.abort.room = state.room
            msg.abort.reason = reason
            self._send(state.sender_endpoint, msg)
        self._release(state)
        self._end(state, TransferError(state.room, reason) if report else None)

    # ---- control loop -----------------------------------------------------------------------

    def _on_message(self, env: transfer_pb2.TransferEnvelope) -> None:
        kind = env.WhichOneof("body")
        if kind == "status":
            state = self._rooms.get(env.status.room)
            if state is not None:
                state.sender_minor = env.minor_version
            self._on_status(env.status)
        elif kind != "heartbeat":
            self.counters["unexpected_message"] += 1

    def _on_status(self, status: transfer_pb2.TransferStatus) -> None:
        state = self._rooms.get(status.room)
        if status.room in self._quarantine and not status.write_in_flight:
            for allocation, _ in self._quarantine.pop(status.room):
                self._free(allocation)  # the sender says nothing is in flight any more
            if state is None:
                return
        if state is None:
            self.counters["unknown_room"] += 1
            return
        rstate = RoomState(status.state) if status.state <= RoomState.FAILED else None
        if rstate == RoomState.FAILED:
            state.awaiting_write = status.write_in_flight
            state.init_sent = False  # the sender already dropped the room
            self._fail(state, status.error or "sender_failed")
            return
        if not state.first_data_at and rstate in (RoomState.TRANSFERRING, RoomState.SUCCESS):
            # the announcement (rooms that continue), or the first chunk minus its write time
            state.first_data_at = time.monotonic() - max(0.0, status.write_s)
        if rstate == RoomState.TRANSFERRING and status.num_tokens == 0:
            self._on_announcement(state, status)
            return
        if rstate not in (RoomState.TRANSFERRING, RoomState.SUCCESS) or not state.awaiting_write:
            self.counters["unexpected_status"] += 1
            return
        state.awaiting_write = False  # the write has returned on the sender
        self._absorb_chunk(state, status, rstate)

    def _absorb_chunk(
        self, state: ReceiverRoom, status: transfer_pb2.TransferStatus, rstate: RoomState
    ) -> None:
        assert state.allocation is not None
        try:
            first_block = state.num_tokens_in_place // self.layout.block_size  # see chunks.py
            record = self.buffers.aux_bytes(state.allocation.block_ids[first_block])
            room, aux, chunk = aux_record.unpack(record)
            problem = state.check_chunk(room, aux, chunk, status.num_tokens)
            allocated = state.allocation.num_tokens - state.num_tokens_in_place
            if not problem and chunk.num_tokens > allocated:
                problem = "aux_mismatch: chunk larger than the allocation"
            if not problem and aux.total_tokens != status.total_tokens:
                problem = "aux_mismatch: total_tokens differs from the status"
        except ValueError as exc:
            problem = f"aux_mismatch: {exc}"
        if problem:
            self._fail(state, problem)
            return
        state.land(aux, chunk)
        self.num_transfers += 1
        self.bytes_received += chunk.num_tokens * 16 + chunk.num_image_rows * self.layout.row_bytes
        done = state.received == aux.total_tokens
        if done != (rstate == RoomState.SUCCESS):
            self._fail(state, f"aux_mismatch: status {rstate.name} at {state.received} tokens")
            return
        if done:
            self._deliver(state)
            return
        if state.continuation_at:  # asked for at the announcement: its write may be landing
            if state.received != state.continuation_at:
                self._fail(
                    state,
                    f"aux_mismatch: chunk ended at {state.received}, expected "
                    f"{state.continuation_at}",
                )
                return
            state.continuation_at = 0
            state.awaiting_write = True
            state.move(RoomState.TRANSFERRING)
            return
        grown = self._extend(state)
        if grown is not None:  # the rest lands behind what arrived: nothing is copied
            state.move(RoomState.TRANSFERRING)
            self._send_init(state, grown)
            return
        state.copy_out(self.buffers)
        self._release(state)
        state.move(RoomState.TRANSFERRING)
        state.deadline = time.monotonic() + self.config.waiting_timeout_s
        self._cont_queue.append(state.room)
        self._schedule()

    def _on_announcement(self, state: ReceiverRoom, status: transfer_pb2.TransferStatus) -> None:
        """The sender starts the first chunk of a room that will continue. If the room can
        stay in its blocks, extend them now and ask for the rest at once, so the sender goes on
        as soon as the first chunk is written; else assemble the request's memory meanwhile."""
        total = status.total_tokens
        if state.aux is not None or not 0 <= status.num_image_rows <= total:
            return
        if state.allocation is None or not state.awaiting_write or state.received:
            return
        first = state.allocation.num_tokens  # what the first chunk carries: total exceeds it
        grown = None
        if total > first and self._can_hold(state, total):
            grown = self.allocator.extend(state.allocation, total)
        if grown is None:
            state.prepare(total, status.num_image_rows, self.layout)
            return
        state.continuation_at = first
        self.counters["continuation_ahead"] += 1
        self._send_init(state, grown, sent_tokens=first)

    def _deliver(self, state: ReceiverRoom) -> None:
        """The whole room arrived: lend its blocks (keeping only those the rows sit in) or copy
        it out and free them; then report SUCCESS."""
        assert state.aux is not None and state.allocation is not None
        in_place = state.holds_whole_prefix and self._may_lend(state.aux.total_tokens)
        if in_place and state.lend_in_place(self.buffers):
            kept = self.allocator.shrink(state.allocation, state.received)
            self._lent[state.room], state.allocation = kept, None
            self.num_rooms_lent += 1
            self._schedule()
        else:
            state.copy_out(self.buffers)
            self._release(state)
        state.move(RoomState.SUCCESS)
        if self.on_room_done is not None:
            self.on_room_done(state.num_transfers)
        self._end(state, state.result())

    def _extend(self, state: ReceiverRoom) -> Allocation | None:
        """Grow the room's blocks to hold the whole request, if it may be lent when done and
        the sender can write behind what arrived; None to fall back to copy-and-continue."""
        assert state.aux is not None and state.allocation is not None
        if not self._can_hold(state, state.aux.total_tokens):
            return None
        return self.allocator.extend(state.allocation, state.aux.total_tokens)

    def _can_hold(self, state: ReceiverRoom, total_tokens: int) -> bool:
        return (
            state.holds_whole_prefix
            and state.sender_minor >= messages.MINOR_DEST_OFFSETS
            and self._may_lend(total_tokens)
        )

    def _on_tick(self, now: float) -> None:
        for room, entries in list(self._quarantine.items()):
            keep = [(a, d) for a, d in entries if d > now]
            for allocation, deadline in entries:
                if deadline <= now:
                    self._free(allocation)
            if keep:
                self._quarantine[room] = keep
            else:
                del self._quarantine[room]
        for state in list(self._rooms.values()):
            if now > state.request_deadline:
                self._fail(state, f"deadline: request deadline passed in {state.state.name}")
            elif now > state.deadline:
                self._fail(state, f"timeout: in {state.state.name}")
        active = {s.sender_endpoint for s in self._rooms.values() if s.init_sent}
        for ep in self.peers.silent(active, now):
            for state in list(self._rooms.values()):
                if state.sender_endpoint == ep and state.init_sent:
                    self._fail(state, f"sender_dead: {ep} silent")
        self._send_heartbeats(active, now)
