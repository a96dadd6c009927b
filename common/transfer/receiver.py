"""Language side of the transfer plane: pulls each room's embeddings in one or more chunks.

Room flow (receiver view)::

    add_room -> BOOTSTRAPPING (queued until default_tokens of blocks are free; the room is
                              claimed meanwhile, so the sender holds it for us)
             -> WAITING_FOR_INPUT (init sent with sent_tokens = 0; the sender acknowledges it
                              while the encoder still works on the room)
             -> TRANSFERRING (a chunk landed, more remains: either extend the room's blocks to
                              the whole request and ask for the rest behind what arrived, or
                              copy it out, free the blocks and alloc_up_to(rest); continuation
                              init with sent_tokens = received)
             -> SUCCESS (the whole request is assembled)   | FAILED from anywhere

Timeouts measure liveness and the request's deadline: a room waits for our own blocks until
its deadline (``waiting_timeout_s`` without one); an init waits for the sender's answer
``bootstrap_timeout_s + transfer_timeout_s``, and once the sender acknowledged it ("still
encoding", ``wait_s``) as long as the sender said it holds it, plus a write and a heartbeat
timeout; a continuation ``transfer_timeout_s + heartbeat_timeout_s``. A sender silent for
``heartbeat_timeout_s`` (it heartbeats us while any room of ours waits, data or not), or one
answering with a new incarnation, fails its rooms; the request's deadline bounds every state.

Zero-copy delivery: a room whose chunks all landed in its blocks, rows in one run of slots, is
delivered as a view of them (``ReceivedEmbeddings.lent``); the blocks stay lent until the
consumer calls ``release(room)``. Buffer priority: waiting continuations are served before any
new room. Blocks into which a write may still land (an init is out) are never freed on failure
or abort: they go to quarantine until the sender acknowledges (a FAILED status without
``write_in_flight``) or ``config.quarantine_s`` passes. Status handling is in
``receiver_chunks.py``.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable

from protos.epd.v1 import transfer_pb2

from . import chunks, messages
from .allocator import Allocation
from .config import TransferConfig
from .control import MAX_INIT_BLOCKS
from .layout import BufferLayout
from .receiver_chunks import ReceiverChunks
from .receiver_room import ReceiverRoom
from .transport import uses_shm
from .types import FailureKind, ReceivedChunk, ReceivedEmbeddings, RoomState, TransferError

logger = logging.getLogger(__name__)

MAX_FINISHED_ROOMS = 100_000
Done = tuple[int, ReceivedEmbeddings | TransferError | ReceivedChunk]


class EmbeddingReceiver(ReceiverChunks):
    def __init__(
        self, config: TransferConfig, layout: BufferLayout, report_progress: bool = False
    ) -> None:
        # report each chunk of a room still in flight (``ReceivedChunk``) before its outcome
        self.report_progress = report_progress
        self._rooms: dict[int, ReceiverRoom] = {}
        self._finished: collections.OrderedDict[int, RoomState] = collections.OrderedDict()
        self._done: list[Done] = []
        self._new_queue: collections.deque[int] = collections.deque()
        self._cont_queue: collections.deque[int] = collections.deque()
        # room -> (its sender, [(blocks a write may still hit, until when)])
        self._quarantine: dict[int, tuple[str, list[tuple[Allocation, float]]]] = {}
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
        # ``_done`` has a lock of its own: a consumer waiting in ``pop_done`` is woken by the
        # loop thread that delivers a room and takes the list without queueing for the
        # endpoint's lock, which that thread still holds (lock order: endpoint, then done)
        self._done_ready = threading.Condition(threading.Lock())
        super().__init__(config, layout, shared=uses_shm(config.transport))
        self._init_template = self._make_init_template()

    # ---- public API -------------------------------------------------------------------------

    def add_room(self, room: int, sender_endpoint: str, deadline: float | None = None) -> None:
        """Start pulling ``room`` from the sender at ``sender_endpoint``; ``deadline``
        (``time.monotonic()`` clock) is the request's own: the room fails once it passes."""
        if not messages.valid_endpoint(sender_endpoint):
            raise ValueError(f"sender_endpoint {sender_endpoint[:80]!r} is not tcp://HOST:PORT")
        if deadline is not None and math.isnan(deadline):
            raise ValueError("deadline must be a time.monotonic() value, got nan")
        with self._lock:
            if room in self._rooms or room in self._finished:
                raise ValueError(f"room {room} already added")
            state = ReceiverRoom(room, sender_endpoint)
            if deadline is not None:
                state.request_deadline = deadline
            state.deadline = self._waiting_bound(state, time.monotonic())
            self._rooms[room] = state
            self._new_queue.append(room)
            self._schedule()
            if not state.known_to_sender:  # queued for blocks: tell the sender it is wanted
                self._send_claim(state)
        self._wake()

    def poll(self, room: int) -> RoomState:
        """The room's state; KeyError for a room never added (or aborted)."""
        with self._lock:
            if room in self._rooms:
                return self._rooms[room].state
            return self._finished[room]

    def pop_done(self, timeout_s: float = 0.0) -> list[Done]:
        """Rooms that ended since the last call, each reported exactly once (aborts excluded);
        with ``report_progress`` also the chunks that landed meanwhile (``ReceivedChunk``), in
        order, before their room's outcome.

        With ``timeout_s`` > 0, waits up to that long for at least one.
        """
        with self._done_ready:
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
        self._wake()

    def abort(self, room: int) -> None:
        """Drop ``room`` whatever its state; blocks a write may still hit stay quarantined."""
        with self._lock:
            state = self._rooms.get(room)
            if state is not None:
                kind = FailureKind.ABORTED
                self._fail(state, kind, kind.reason("by the receiver"), report=False)
            with self._done_ready:
                self._done = [d for d in self._done if d[0] != room]
            self._finished.pop(room, None)
            self.release(room)

    def stats(self) -> dict:
        with self._lock:
            return {
                **self._common_stats(self._finished.values()),
                "num_quarantined_blocks": sum(
                    len(a.block_ids) for _, q in self._quarantine.values() for a, _ in q
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
            kind = FailureKind.CLOSED
            for state in list(self._rooms.values()):
                self._fail(state, kind, kind.reason("receiver shut down"), report=False)
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
            accepts_partial=True,
            accepts_inline=True,
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
        state.awaiting_write = state.known_to_sender = True
        self.peers.watch(state.sender_endpoint, now)
        if state.state == RoomState.BOOTSTRAPPING:
            state.move(RoomState.WAITING_FOR_INPUT)
            state.deadline = now + self.config.bootstrap_timeout_s + self.config.transfer_timeout_s
        else:
            state.deadline = now + self.config.transfer_timeout_s + self.config.heartbeat_timeout_s
        self._send(state.sender_endpoint, msg)

    def _send_claim(self, state: ReceiverRoom) -> None:
        """Claim a room whose init must wait for our blocks: the sender holds it for us as
        long as we live (heartbeats) instead of ``bootstrap_timeout_s``. Minor 5; an older
        sender ignores it."""
        msg = self._envelope()
        msg.claim.room = state.room
        state.known_to_sender = True
        self.peers.watch(state.sender_endpoint, time.monotonic())
        self._send(state.sender_endpoint, msg)

    def _waiting_bound(self, state: ReceiverRoom, now: float) -> float:
        """Waiting for our own blocks is queueing, not a peer's liveness: the request's
        deadline bounds it, or ``waiting_timeout_s`` for a request without one."""
        if math.isfinite(state.request_deadline):
            return math.inf
        return now + self.config.waiting_timeout_s

    def _schedule(self) -> None:
        """Hand free blocks out: continuations first (what is free), then new rooms (default)."""
        most = MAX_INIT_BLOCKS * self.layout.block_size
        while self._cont_queue:
            state = self._rooms.get(self._cont_queue[0])
            if state is None or state.state.is_final:
                self._cont_queue.popleft()
                continue
            allocation = self.allocator.alloc_up_to(
                min(state.aux.total_tokens - state.received, most)
            )
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

    def _free(self, allocation: Allocation) -> None:
        self.allocator.free(allocation)
        self._schedule()

    def _release(self, state: ReceiverRoom) -> None:
        allocation, state.allocation = state.allocation, None
        if allocation is None:
            return
        if state.awaiting_write:
            deadline = time.monotonic() + self.config.quarantine_s
            held = self._quarantine.setdefault(state.room, (state.sender_endpoint, []))
            held[1].append((allocation, deadline))
        else:
            self._free(allocation)

    def _end(self, state: ReceiverRoom, outcome: ReceivedEmbeddings | TransferError | None) -> None:
        self._rooms.pop(state.room, None)
        if outcome is not None:
            self._finished[state.room] = state.state
            while len(self._finished) > MAX_FINISHED_ROOMS:
                self._finished.popitem(last=False)
            self._report(state.room, outcome)

    def _report(self, room: int, outcome: ReceivedEmbeddings | TransferError | ReceivedChunk):
        with self._done_ready:
            self._done.append((room, outcome))
            self._done_ready.notify_all()
        if self.on_done is not None:
            self.on_done()

    def _fail(
        self, state: ReceiverRoom, kind: FailureKind, reason: str, report: bool = True
    ) -> None:
        if state.state.is_final:
            return
        state.move(RoomState.FAILED)
        state.kind = kind
        self._failed_by_reason[kind.label] += 1
        if state.known_to_sender:
            msg = self._envelope()
            msg.abort.room = state.room
            msg.abort.reason = reason
            msg.abort.kind = int(kind)
            self._send(state.sender_endpoint, msg)
        self._release(state)
        self._end(state, TransferError(state.room, reason, kind) if report else None)

    # ---- control loop -----------------------------------------------------------------------

    def _on_message(self, env: transfer_pb2.TransferEnvelope) -> None:
        kind = env.WhichOneof("body")
        if kind == "status":
            self._on_status(env)
        elif kind != "heartbeat":
            self.counters["unexpected_message"] += 1

    def _on_peer_restarted(self, endpoint: str, old_incarnation: int) -> None:
        kind = FailureKind.PEER_RESTARTED
        for state in list(self._rooms.values()):
            bound = (state.sender_endpoint, state.sender_incarnation)
            if state.known_to_sender and bound == (endpoint, old_incarnation):
                state.known_to_sender = False  # the new process never heard of the room
                self._fail(state, kind, kind.reason(f"sender {endpoint} restarted"))

    def _on_tick(self, now: float) -> None:
        for room, (sender, entries) in list(self._quarantine.items()):
            keep = [(a, d) for a, d in entries if d > now]
            for allocation, deadline in entries:
                if deadline <= now:
                    self._free(allocation)
            if keep:
                self._quarantine[room] = (sender, keep)
            else:
                del self._quarantine[room]
        for state in list(self._rooms.values()):
            if now >= state.request_deadline:
                kind = FailureKind.DEADLINE
                self._fail(
                    state, kind, kind.reason(f"request deadline passed in {state.state.name}")
                )
            elif now >= state.deadline:
                kind = FailureKind.TIMEOUT
                self._fail(state, kind, kind.reason(_timeout_detail(state)))
        active = self._active_peers()
        for ep in self.peers.silent(active, now):
            kind = FailureKind.SENDER_DEAD
            detail = f"{ep} silent for {self.peers.silence(ep, now):.1f} s"
            for state in list(self._rooms.values()):
                # NOTE: a room only claimed (still queued for our blocks) waits for us, not for
                # the sender; a sender older than minor 5 ignores claims and sends no heartbeat
                asked = state.state != RoomState.BOOTSTRAPPING
                if state.sender_endpoint == ep and state.known_to_sender and asked:
                    self._fail(state, kind, kind.reason(detail))
            self.channel.reconnect(ep)  # its connection may be backed off (a partition)
        self._send_heartbeats(self._active_peers(), now)

    def _active_peers(self) -> set[str]:
        return {s.sender_endpoint for s in self._rooms.values() if s.known_to_sender}

    def _next_due(self) -> float | None:
        times = [min(s.deadline, s.request_deadline) for s in self._rooms.values()]
        times.extend(d for _, entries in self._quarantine.values() for _, d in entries)
        peer_due = self.peers.next_due(self._active_peers())
        if peer_due is not None:
            times.append(peer_due)
        due = min(times, default=math.inf)
        return due if math.isfinite(due) else None


def _timeout_detail(state: ReceiverRoom) -> str:
    where = f"in {state.state.name}: "
    if state.state == RoomState.BOOTSTRAPPING:
        return where + "no free blocks"
    if state.state == RoomState.WAITING_FOR_INPUT:
        if state.acked:
            return where + "the sender held the init past the time it gave"
        return where + "the sender did not answer the init"
    if state.awaiting_write:
        return where + "the chunk did not land"
    return where + "no free blocks for the continuation"
