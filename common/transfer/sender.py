"""Encoder side of the transfer plane: holds each request's data until its receiver pulls it.

Room flow (sender view)::

    expect() --- announced: waits for data and init until the request's deadline
    submit() --+-- init already there --> write chunk --> TRANSFERRING --(init)--> ... SUCCESS
               +-- no init yet: BOOTSTRAPPING
    init ------+-- no data yet: WAITING_FOR_INPUT, acknowledged ("still encoding", wait_s)
    claim ------- the receiver waits for blocks: the room is bound to it, no state change

Timeouts measure liveness and the request's deadline, not how long the encoder works: a room
the encoder announced (``expect``) waits for its data, and its init for the data, until the
request's deadline, as long as the receiver is alive (heartbeats). Until a receiver asked for
it (init) or claimed it (a receiver short of blocks, minor 5), an announced room waits
``bootstrap_timeout_s``: its gateway may have died before any receiver heard of it. A room
nobody announced waits ``bootstrap_timeout_s`` too (a gateway that died between its two calls
must not pin blocks), a continuation init ``waiting_timeout_s`` (announced: the deadline), a write
``transfer_timeout_s``. A receiver silent for ``heartbeat_timeout_s``, or answering with a new
incarnation, fails its rooms. Taking the data in (``submit``, or ``begin`` and ``add_rows``
image by image) is in ``sender_intake.py``, the write half (queues, writer threads) in
``sender_writes.py``.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from protos.epd.v1 import transfer_pb2

from .config import TransferConfig
from .layout import BufferLayout
from .sender_intake import SenderIntake
from .sender_room import SenderRoom
from .types import FailureKind, RoomState

logger = logging.getLogger(__name__)

MAX_FINISHED_ROOMS = 100_000
MAX_UNANNOUNCED_ROOMS = 10_000  # rooms created by an init alone, waiting for the encoder
MAX_PEER_TEXT = 200  # characters of a peer's free text kept in a failure reason


class Ended(NamedTuple):
    state: RoomState
    kind: FailureKind = FailureKind.UNSPECIFIED
    reason: str = ""


class EmbeddingSender(SenderIntake):
    def __init__(self, config: TransferConfig, layout: BufferLayout) -> None:
        self._rooms: dict[int, SenderRoom] = {}
        # ended rooms: their final state, and why a failed one failed (told to late inits)
        self._finished: collections.OrderedDict[int, Ended] = collections.OrderedDict()
        self._failed_by_reason: collections.Counter[str] = collections.Counter()
        self._init_writes()
        # Observer of each successful chunk write: (bytes, seconds). Set by the metrics.
        self.on_write: Callable[[int, float], None] | None = None
        self._shm_sweep_due = False
        self._writers = ThreadPoolExecutor(config.num_writers, thread_name_prefix="epd-writer")
        super().__init__(config, layout, shared=False)

    # ---- public API -------------------------------------------------------------------------

    def expect(self, room: int, deadline: float) -> None:
        """The encoder accepted ``room``: its data will be submitted (or the room failed with
        ``fail``) before ``deadline`` (``time.monotonic()`` clock, finite).

        Until then the data waits for the receiver's init and an init waits for the data, as
        long as the receiver is alive; at the deadline the room fails in whatever state it is.
        A room no receiver asked for (init) or claimed fails after ``bootstrap_timeout_s``.
        Calling it again moves the deadline; a room that already ended is left alone.
        """
        if not math.isfinite(deadline):
            raise ValueError(f"deadline must be a finite time.monotonic() value, got {deadline}")
        with self._lock:
            if room in self._finished:
                return
            state = self._rooms.get(room)
            if state is None:
                state = self._rooms[room] = SenderRoom(room)
            state.request_deadline = deadline
            now = time.monotonic()
            self._arm(state, now)
            if state.init is not None and not state.has_data:
                self._ack(state, now)  # the receiver may now wait until the deadline
        self._wake()

    def fail(self, room: int, reason: str) -> None:
        """Encoding failed or was cancelled: the receiver gets FAILED (``encode_failed``).

        Our blocks are freed at once unless a write is in flight (then as soon as it returns,
        and the receiver is told so); data submitted later for the room is dropped.
        """
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                if room not in self._finished:
                    kind = FailureKind.ENCODE_FAILED
                    self._remember(room, Ended(RoomState.FAILED, kind, kind.reason(reason)))
                    self._failed_by_reason[kind.label] += 1
                return
            self._fail(state, FailureKind.ENCODE_FAILED, reason)
        self._wake()  # the loop forgets peers left without rooms

    def poll(self, room: int) -> RoomState:
        """The room's state; KeyError for a room this sender never heard of."""
        with self._lock:
            if room in self._rooms:
                return self._rooms[room].state
            return self._finished[room].state

    def stats(self) -> dict:
        with self._lock:
            return {
                **self._common_stats(e.state for e in self._finished.values()),
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

    def _remember(self, room: int, ended: Ended) -> None:
        self._finished[room] = ended
        while len(self._finished) > MAX_FINISHED_ROOMS:
            self._finished.popitem(last=False)

    def _arm(self, state: SenderRoom, now: float) -> None:
        if state.writing:
            return  # bounded by transfer_timeout_s from when the job was queued
        if state.expected and state.receiver_endpoint:
            state.deadline = state.request_deadline
        elif state.expected:  # no receiver asked for it yet
            state.deadline = min(state.request_deadline, now + self.config.bootstrap_timeout_s)
        elif state.state == RoomState.TRANSFERRING:
            state.deadline = now + self.config.waiting_timeout_s
        else:
            state.deadline = now + self.config.bootstrap_timeout_s

    def _status(self, state: SenderRoom, rstate: RoomState, **fields) -> None:
        self._status_to(state.receiver_endpoint, state.room, rstate, **fields)

    def _status_to(self, endpoint: str, room: int, rstate: RoomState, **fields) -> None:
        if not endpoint:
            return
        msg = self._envelope()
        msg.status.room = room
        msg.status.state = int(rstate)
        for key, value in fields.items():
            setattr(msg.status, key, value)
        self._send(endpoint, msg)

    def _ack(self, state: SenderRoom, now: float) -> None:
        """Tell the receiver its init is held for the data ("still encoding") and how long."""
        wait_s = max(0.0, min(state.deadline, state.request_deadline) - now)
        self._status(state, RoomState.WAITING_FOR_INPUT, wait_s=wait_s)

    def _finish(self, state: SenderRoom) -> None:
        if state.allocation is not None:
            self.allocator.free(state.allocation)
            state.allocation = None
        self._rooms.pop(state.room, None)
        self._remember(state.room, Ended(state.state, state.kind, state.reason))
        self._shm_sweep_due = True

    def _fail(self, state: SenderRoom, kind: FailureKind, detail: str) -> None:
        reason = kind.reason(detail)
        if not state.fail(kind, reason):
            return
        self._failed_by_reason[kind.label] += 1
        logger.info("room %d failed: %s", state.room, reason)
        if state.writing and not state.write_started:
            self._dequeue(state)  # queued, never started: nothing can be in flight
        self._status(
            state,
            RoomState.FAILED,
            error=reason,
            error_kind=int(kind),
            write_in_flight=state.writing,
        )
        if state.writing:
            state.ack_pending = True  # the writer frees the blocks and acknowledges
        else:
            self._finish(state)

    # ---- control loop -----------------------------------------------------------------------

    def _on_message(self, env: transfer_pb2.TransferEnvelope) -> None:
        kind = env.WhichOneof("body")
        if kind == "init":
            self._on_init(env)
        elif kind == "claim":
            self._on_claim(env)
        elif kind == "abort":
            self._on_abort(env)
        elif kind != "heartbeat":
            self.counters["unexpected_message"] += 1

    def _on_abort(self, env: transfer_pb2.TransferEnvelope) -> None:
        room = env.abort.room
        state = self._rooms.get(room)
        if state is None:
            self.counters["unknown_room"] += 1
            kind = FailureKind.ABORTED
            error = kind.reason("the sender holds nothing for this room")
            # nothing is in flight: lets the receiver free blocks it quarantined
            self._status_to(
                env.from_endpoint, room, RoomState.FAILED, error=error, error_kind=int(kind)
            )
            if room not in self._finished:
                self._remember(room, Ended(RoomState.FAILED, kind, error))
            return
        if state.receiver_endpoint != env.from_endpoint:
            self.counters["wrong_peer"] += 1
            return
        self._fail(state, FailureKind.ABORTED, env.abort.reason[:MAX_PEER_TEXT] or "by receiver")

    def _room_of(self, env: transfer_pb2.TransferEnvelope, room: int) -> SenderRoom | None:
        """The room an init or claim (``env``) asks for, created when new; None when the
        message is to be dropped (the receiver is told when the room already failed)."""
        peer = env.from_endpoint
        state = self._rooms.get(room)
        if state is None:
            ended = self._finished.get(room)
            if ended is not None:
                if ended.state == RoomState.FAILED:  # failed before the receiver asked
                    self._status_to(
                        peer,
                        room,
                        RoomState.FAILED,
                        error=ended.reason or "failed before the init arrived",
                        error_kind=int(ended.kind),
                    )
                else:
                    self.counters["stale_init"] += 1
                return None
            if self._num_unannounced() >= MAX_UNANNOUNCED_ROOMS:
                self.counters["rejected_init"] += 1
                kind = FailureKind.BAD_INIT
                error = kind.reason(f"{MAX_UNANNOUNCED_ROOMS} rooms already wait for data")
                self._status_to(peer, room, RoomState.FAILED, error=error, error_kind=int(kind))
                return None
            state = self._rooms[room] = SenderRoom(room)
        elif state.receiver_endpoint and state.receiver_endpoint != peer:
            self.counters["wrong_peer"] += 1
            return None
        return state

    def _bind(self, state: SenderRoom, env: transfer_pb2.TransferEnvelope, now: float) -> None:
        """The first receiver to ask for (or claim) a room is its receiver for good."""
        if not state.receiver_endpoint:
            state.receiver_endpoint, state.receiver_incarnation = env.from_endpoint, env.incarnation
            self.peers.watch(env.from_endpoint, now, env.incarnation)

    def _on_claim(self, env: transfer_pb2.TransferEnvelope) -> None:
        """A receiver waits for the room but has no blocks for its init yet: hold the room for
        it (until the request's deadline when announced) as long as it lives."""
        state = self._room_of(env, env.claim.room)
        if state is None or state.receiver_endpoint:
            return
        now = time.monotonic()
        self._bind(state, env, now)
        self._arm(state, now)

    def _on_init(self, env: transfer_pb2.TransferEnvelope) -> None:
        init, peer = env.init, env.from_endpoint
        if init.receiver_endpoint != peer:  # replies go where the frame came from, nowhere else
            self.counters["rejected_init"] += 1
            return
        now = time.monotonic()
        state = self._room_of(env, init.room)
        if state is None:
            return
        current = state.init
        if current is None and not (state.writing and init.sent_tokens <= state.sent_tokens):
            slot = "init"
        elif (
            current is not None
            and state.next_init is None
            and init.sent_tokens == current.sent_tokens + current.num_tokens_allocated
        ):
            slot = "next_init"  # a continuation asked for while the current init is served
        else:
            self.counters["duplicate_init"] += 1
            return
        self._bind(state, env, now)
        setattr(state, slot, init)
        if state.has_data:
            self._maybe_write(state)
            return
        state.move(RoomState.WAITING_FOR_INPUT)
        self._arm(state, now)
        self._ack(state, now)

    def _num_unannounced(self) -> int:
        return sum(1 for s in self._rooms.values() if not s.expected and not s.has_data)

    def _on_peer_restarted(self, endpoint: str, old_incarnation: int) -> None:
        for state in list(self._rooms.values()):
            if (state.receiver_endpoint, state.receiver_incarnation) == (endpoint, old_incarnation):
                self._fail(state, FailureKind.PEER_RESTARTED, f"receiver {endpoint} restarted")

    def _on_tick(self, now: float) -> None:
        for state in list(self._rooms.values()):
            if state.state.is_final:
                continue
            if now >= state.request_deadline:
                detail = f"request deadline passed in {state.state.name}"
                self._fail(state, FailureKind.DEADLINE, detail)
            elif now >= state.deadline:
                self._fail(state, *self._timeout_of(state))
        active = self._active_peers()
        for ep in self.peers.silent(active, now):
            detail = f"{ep} silent for {self.peers.silence(ep, now):.1f} s"
            for state in list(self._rooms.values()):
                if state.receiver_endpoint == ep:
                    self._fail(state, FailureKind.RECEIVER_DEAD, detail)
            self.channel.reconnect(ep)  # its connection may be backed off (a partition)
        self._send_heartbeats(self._active_peers(), now)
        if self._shm_sweep_due and self.shm is not None:
            self._shm_sweep_due = False
            self.shm.release_missing()  # receivers that closed unlinked their regions

    @staticmethod
    def _timeout_of(state: SenderRoom) -> tuple[FailureKind, str]:
        if state.writing:
            return FailureKind.TRANSFER_TIMEOUT, "write did not finish"
        if state.expected and not state.receiver_endpoint:
            return FailureKind.BOOTSTRAP_TIMEOUT, "no receiver asked for the room or claimed it"
        if state.state == RoomState.TRANSFERRING and state.init is not None:
            return FailureKind.WAITING_TIMEOUT, "the rest of the rows did not come"
        if state.state == RoomState.TRANSFERRING:
            return FailureKind.WAITING_TIMEOUT, "no continuation init"
        if state.has_data:
            return FailureKind.BOOTSTRAP_TIMEOUT, "data and init did not meet: no init came"
        return FailureKind.BOOTSTRAP_TIMEOUT, "data and init did not meet: the data did not come"

    def _active_peers(self) -> set[str]:
        return {
            s.receiver_endpoint
            for s in self._rooms.values()
            if s.receiver_endpoint and not s.state.is_final
        }

    def _next_due(self) -> float | None:
        times = [
            min(s.deadline, s.request_deadline)
            for s in self._rooms.values()
            if not s.state.is_final
        ]
        peer_due = self.peers.next_due(self._active_peers())
        if peer_due is not None:
            times.append(peer_due)
        if self._shm_sweep_due and self.shm is not None:
            return time.monotonic()
        due = min(times, default=math.inf)
        return due if math.isfinite(due) else None
