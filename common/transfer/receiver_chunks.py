"""The status half of the receiver: what to do when the sender says something about a room.

A status is only believed from the room's own sender (its ``sender_endpoint``) once an init is
out. ``WAITING_FOR_INPUT`` acknowledges the first init ("still encoding": the sender holds it
for ``wait_s``); an announcement (``TRANSFERRING``, no tokens) lets the room grow its blocks
and ask for the rest at once; a landed chunk is checked against the aux record the sender wrote
into our own buffer, then the room is delivered (lent in place, or copied out), extended for a
continuation, or copied out to wait for blocks. Lending policy: lent blocks stay within
``max_lent_fraction`` of the buffer and always leave a default allocation free.
``EmbeddingReceiver`` (``receiver.py``) holds the room flow, block scheduling and timers.
"""

from __future__ import annotations

import math
import time
from abc import abstractmethod

from protos.epd.v1 import transfer_pb2

from . import aux_record, messages
from .allocator import Allocation
from .aux_record import AUX_RECORD_BYTES
from .control import MAX_INIT_BLOCKS
from .endpoint import TransferEndpoint
from .receiver_room import ReceiverRoom
from .types import FailureKind, ReceivedChunk, ReceivedEmbeddings, RoomState, TransferError

MAX_PEER_TEXT = 200  # characters of a peer's error text kept in a failure reason
MAX_ACK_WAIT_S = 86_400.0  # a longer wait_s in an acknowledgement is read as this


class ReceiverChunks(TransferEndpoint):
    """Status handling of an ``EmbeddingReceiver``; every method runs with the lock held."""

    @abstractmethod
    def _fail(self, state: ReceiverRoom, kind: FailureKind, reason: str, report: bool = True):
        """Fail the room (``reason`` is the whole text), abort it at the sender, free blocks."""

    @abstractmethod
    def _send_init(
        self, state: ReceiverRoom, allocation: Allocation, sent_tokens: int | None = None
    ) -> None:
        """Ask the sender for the room from ``sent_tokens`` into ``allocation``."""

    @abstractmethod
    def _release(self, state: ReceiverRoom) -> None:
        """Give up the room's blocks: free, or quarantine while a write may still land."""

    @abstractmethod
    def _end(self, state: ReceiverRoom, outcome: ReceivedEmbeddings | TransferError | None):
        """Forget the room; report ``outcome`` to ``pop_done`` (None: not reported)."""

    @abstractmethod
    def _report(self, room: int, outcome: ReceivedChunk) -> None:
        """Report a chunk of a room still in flight to ``pop_done``."""

    @abstractmethod
    def _free(self, allocation: Allocation) -> None:
        """Free blocks and hand them to waiting rooms."""

    @abstractmethod
    def _schedule(self) -> None:
        """Hand free blocks to waiting rooms."""

    @abstractmethod
    def _waiting_bound(self, state: ReceiverRoom, now: float) -> float:
        """The bound of a room waiting for our own blocks."""

    def _on_status(self, env: transfer_pb2.TransferEnvelope) -> None:
        status = env.status
        if self._unquarantine(status, env.from_endpoint):
            return
        state = self._rooms.get(status.room)
        if state is None:
            self.counters["unknown_room"] += 1
            return
        if env.from_endpoint != state.sender_endpoint:
            self.counters["wrong_peer"] += 1
            return
        rstate = messages.state_from_proto(status.state)
        if not state.known_to_sender or rstate is None:
            self.counters["unexpected_status"] += 1
            return
        state.sender_minor = env.minor_version
        if not state.sender_incarnation:
            state.sender_incarnation = env.incarnation
        if rstate == RoomState.FAILED:
            state.awaiting_write = status.write_in_flight
            state.known_to_sender = False  # the sender already dropped the room
            kind = FailureKind.from_wire(status.error_kind)
            reason = status.error[:MAX_PEER_TEXT] or kind.reason("the sender failed the room")
            self._fail(state, kind, reason)
            return
        if rstate == RoomState.WAITING_FOR_INPUT:
            self._on_ack(state, status)
            return
        if not state.first_data_at and rstate in (RoomState.TRANSFERRING, RoomState.SUCCESS):
            # the announcement (rooms that continue), or the first chunk minus its write time
            state.first_data_at = time.monotonic() - max(0.0, _finite(status.write_s))
        if rstate == RoomState.TRANSFERRING and status.num_tokens == 0:
            self._on_announcement(state, status)
            return
        if rstate not in (RoomState.TRANSFERRING, RoomState.SUCCESS) or not state.awaiting_write:
            self.counters["unexpected_status"] += 1
            return
        state.awaiting_write = False  # the write has returned on the sender
        self._absorb_chunk(state, status, rstate)

    def _unquarantine(self, status: transfer_pb2.TransferStatus, sender: str) -> bool:
        """Free blocks held for the room's sender once it says no write is in flight; True
        when the status was only about those blocks."""
        held = self._quarantine.get(status.room)
        if held is None or status.write_in_flight or held[0] != sender:
            return False
        del self._quarantine[status.room]
        for allocation, _ in held[1]:
            self._free(allocation)
        return status.room not in self._rooms

    def _on_ack(self, state: ReceiverRoom, status: transfer_pb2.TransferStatus) -> None:
        """The sender holds our init until the data comes, for ``wait_s`` at most: wait that
        long (plus a write and a heartbeat timeout) instead of the unacknowledged bound. The
        first init's, or (minor 4) one mid-room while the encoder works on the next image."""
        wait_s = status.wait_s
        if state.received:
            waiting = state.sender_minor >= messages.MINOR_PARTIAL and state.awaiting_write
        else:
            waiting = state.state == RoomState.WAITING_FOR_INPUT and state.awaiting_write
        if not waiting or not wait_s >= 0.0:  # NaN is not >= 0 either
            self.counters["unexpected_status"] += 1
            return
        state.acked = True
        self.counters["acknowledged_inits"] += 1
        slack = self.config.transfer_timeout_s + self.config.heartbeat_timeout_s
        state.deadline = time.monotonic() + min(wait_s, MAX_ACK_WAIT_S) + slack

    def _too_large(self, state: ReceiverRoom, total_tokens: int) -> bool:
        if total_tokens <= self.config.max_room_tokens:
            return False
        kind = FailureKind.TOO_LARGE
        detail = f"{total_tokens} tokens; this receiver accepts {self.config.max_room_tokens}"
        self._fail(state, kind, kind.reason(detail))
        return True

    def _absorb_chunk(
        self, state: ReceiverRoom, status: transfer_pb2.TransferStatus, rstate: RoomState
    ) -> None:
        assert state.allocation is not None
        mismatch = FailureKind.AUX_MISMATCH
        problem = self._store_inline(state, status)
        if problem:
            self._fail(state, mismatch, mismatch.reason(problem))
            return
        try:
            first_block = state.num_tokens_in_place // self.layout.block_size  # see chunks.py
            record = self.buffers.aux_bytes(state.allocation.block_ids[first_block])
            room, aux, chunk = aux_record.unpack(record)
            problem = state.check_chunk(room, aux, chunk, status.num_tokens)
            allocated = state.allocation.num_tokens - state.num_tokens_in_place
            if not problem and chunk.num_tokens > allocated:
                problem = "chunk larger than the allocation"
            if not problem and aux.total_tokens != status.total_tokens:
                problem = "total_tokens differs from the status"
        except (ValueError, IndexError) as exc:
            problem = str(exc)
        if problem:
            self._fail(state, mismatch, mismatch.reason(problem))
            return
        if self._too_large(state, aux.total_tokens):
            return
        state.land(aux, chunk)
        self.num_transfers += 1
        self.bytes_received += chunk.num_tokens * 16 + chunk.num_image_rows * self.layout.row_bytes
        done = state.received == aux.total_tokens
        if done != (rstate == RoomState.SUCCESS):
            detail = f"status {rstate.name} at {state.received} tokens"
            self._fail(state, mismatch, mismatch.reason(detail))
            return
        if done:
            self._deliver(state)
            return
        if self.report_progress:
            self._report(state.room, state.read_chunk(self.buffers, chunk))
        if status.partial:  # more of this init comes as the sender's data becomes ready
            if state.sender_minor < messages.MINOR_PARTIAL or state.num_tokens_in_place >= (
                state.allocation.num_tokens
            ):
                detail = "a partial chunk filled its allocation"
                self._fail(state, mismatch, mismatch.reason(detail))
                return
            state.awaiting_write = True
            state.move(RoomState.TRANSFERRING)
            now = time.monotonic()
            state.deadline = now + self.config.transfer_timeout_s + self.config.heartbeat_timeout_s
            return
        if state.continuation_at:  # asked for at the announcement: its write may be landing
            if state.received != state.continuation_at:
                detail = f"chunk ended at {state.received}, expected {state.continuation_at}"
                self._fail(state, mismatch, mismatch.reason(detail))
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
        state.deadline = self._waiting_bound(state, time.monotonic())
        self._cont_queue.append(state.room)
        self._schedule()

    def _store_inline(self, state: ReceiverRoom, status: transfer_pb2.TransferStatus) -> str:
        """Store the token fields and aux record a chunk carries in its status (minor 6) where
        the sender's write would have put them: behind the room's tokens in place, the record
        at the block of the chunk's first token. Returns why not ("" when stored or none)."""
        fill, pos, record = status.inline_fill_ids, status.inline_positions, status.inline_aux
        if not (fill or pos or record):
            return ""
        assert state.allocation is not None
        at = state.num_tokens_in_place
        num_tokens = status.num_tokens
        if not 0 < num_tokens <= state.allocation.num_tokens - at:
            return f"inline chunk of {num_tokens} tokens does not fit the allocation"
        if (len(fill), len(pos)) != (4 * num_tokens, 12 * num_tokens):
            return f"inline token fields of {len(fill)} + {len(pos)} bytes for {num_tokens} tokens"
        if not 0 < len(record) <= AUX_RECORD_BYTES:
            return f"inline aux record of {len(record)} bytes"
        block_ids = state.allocation.block_ids
        self.buffers.put_token_bytes(block_ids, at, fill, pos)
        self.buffers.set_aux(block_ids[at // self.layout.block_size], record)
        return ""

    def _on_announcement(self, state: ReceiverRoom, status: transfer_pb2.TransferStatus) -> None:
        """The sender starts the first chunk of a room that will continue. If the room can
        stay in its blocks, extend them now and ask for the rest at once, so the sender goes on
        as soon as the first chunk is written; else assemble the request's memory meanwhile."""
        total = status.total_tokens
        if state.aux is not None or not 0 <= status.num_image_rows <= total:
            self.counters["unexpected_status"] += 1
            return
        if state.allocation is None or not state.awaiting_write or state.received:
            self.counters["unexpected_status"] += 1
            return
        if self._too_large(state, total):
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
            and self.allocator.blocks_for(total_tokens) <= MAX_INIT_BLOCKS
            and self._may_lend(total_tokens)
        )

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


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0
