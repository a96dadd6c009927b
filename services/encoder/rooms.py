"""The encoder's rooms: the one owner of each accepted request's state and what it holds.

A room moves forward only (``RoomStatus``: QUEUED -> ENCODED -> SUBMITTED -> SHIPPED) and can
fail from any live state; FAILED and SHIPPED are final. What a room holds belongs to its state
and is dropped as it leaves it: the ViT task while QUEUED, the encoded rows while ENCODED. Once
SUBMITTED the transfer state is the sender's; the shipper only records how it ended. Every other
part (the ViT loop's callback, the shipper, ``Cancel``) changes a room through this table, under
its lock, so a room is failed, cancelled or advanced exactly once whoever gets there first.

A room is *being accepted* from ``begin`` to ``add`` (its ``Encode`` still decoding a video):
its id is taken, and ``cancel`` fails it at once and sets its ``StopCheck``, so the decode stops
at its next frame and ``add`` refuses it (``RequestCancelled``).

Final rooms are kept ``ttl_s`` seconds (at most ``max_finished`` of them) so a late
``WaitEncoded`` still gets the outcome and a room id cannot be reused meanwhile; a room cancelled
before its ``Encode`` arrived is kept the same way, so that ``Encode`` is refused.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from .batcher import EncodeTask
from .errors import RequestCancelled, UnknownRoom
from .stop import StopCheck
from .types import EncodedPrompt, Prompt, RoomStatus

FINAL = (RoomStatus.SHIPPED, RoomStatus.FAILED)
ACTIVE = (RoomStatus.QUEUED, RoomStatus.ENCODED)  # count against the encoder's queue


@dataclass
class RoomRecord:
    room: int
    request_id: str
    num_tokens: int
    num_images: int
    deadline: float = float("inf")  # time.monotonic(): the request's own
    status: RoomStatus = RoomStatus.QUEUED
    error: str = ""
    num_cache_hits: int = 0
    encode_s: float = 0.0
    accepted_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    task: EncodeTask | None = None  # QUEUED: its images on the ViT loop
    prompt: Prompt | None = None  # QUEUED: its tokens (shipped image by image)
    encoded: EncodedPrompt | None = None  # ENCODED: rows waiting for transfer blocks
    num_rows_shipped: int = -1  # rows handed to the sender before the last image (-1: none)


class Cancelled(NamedTuple):
    found: bool  # the room was known here (live, being accepted or final)
    task: EncodeTask | None  # its ViT task, to take off the loop (when it was QUEUED)


class RoomTable:
    def __init__(self, ttl_s: float, max_finished: int = 100_000) -> None:
        self._ttl_s = ttl_s
        self._max_finished = max_finished
        self._records: dict[int, RoomRecord] = {}
        # live rooms by state, in the order they entered it; final ones by finishing time
        self._live: dict[RoomStatus, dict[int, RoomRecord]] = {
            status: {} for status in RoomStatus if status not in FINAL
        }
        self._finished: collections.OrderedDict[int, float] = collections.OrderedDict()
        self._accepting: dict[int, StopCheck] = {}  # rooms between ``begin`` and ``add``
        self._cond = threading.Condition()

    def begin(self, room: int, stop: StopCheck) -> None:
        """Take ``room``'s id for an ``Encode`` being accepted; ``cancel`` sets ``stop``. End it
        with ``add`` or, when the request is refused, ``end_accept``.

        Raises ValueError when the id is in use (live, being accepted, or ended within the TTL).
        """
        with self._cond:
            self._expire()
            self._check_free(room)
            self._accepting[room] = stop

    def end_accept(self, room: int) -> None:
        """The ``Encode`` of a room that ``begin`` took ended without ``add`` (or after it)."""
        with self._cond:
            self._accepting.pop(room, None)

    def known(self, room: int) -> bool:
        """Whether ``room``'s id is in use here (live, being accepted, or final)."""
        with self._cond:
            return room in self._records or room in self._accepting

    def add(self, record: RoomRecord, max_active: int) -> bool:
        """Register ``record``, ending its accept (``begin``, when it had one); False when
        ``max_active`` rooms are still being encoded.

        Raises ``RequestCancelled`` when the room was cancelled while it was being accepted, and
        ValueError when the room id is already in use (live, or ended within the TTL).
        """
        with self._cond:
            stop = self._accepting.pop(record.room, None)
            if stop is not None and stop.cancelled:
                raise RequestCancelled(f"{stop.reason} while it was accepted")
            self._expire()
            self._check_free(record.room)
            if self._num_active() >= max_active:
                return False
            self._records[record.room] = record
            self._live[record.status][record.room] = record
            return True

    def discard(self, room: int) -> None:
        """Forget a room that was never started."""
        with self._cond:
            record = self._records.pop(room, None)
            if record is not None:
                self._live.get(record.status, {}).pop(room, None)
            self._finished.pop(room, None)

    def advance(self, room: int, status: RoomStatus, **fields) -> bool:
        """Move ``room`` forward to ``status`` (not FAILED: see ``fail``), setting ``fields``;
        False, and nothing changed, when the room is gone, final or already past ``status``."""
        with self._cond:
            record = self._records.get(room)
            if record is None or record.status in FINAL or status <= record.status:
                return False
            for name, value in fields.items():
                setattr(record, name, value)
            self._move(record, status)
            return True

    def fail(self, room: int, reason: str) -> bool:
        """Fail a live ``room``; False when it is unknown or already final."""
        with self._cond:
            record = self._records.get(room)
            if record is None or record.status in FINAL:
                return False
            record.error = reason
            self._move(record, RoomStatus.FAILED)
            return True

    def cancel(self, room: int, reason: str) -> Cancelled:
        """Fail ``room`` if live. One being accepted is failed too and its ``StopCheck`` set;
        an unknown room is remembered as cancelled (for the TTL) all the same."""
        with self._cond:
            record = self._records.get(room)
            if record is None:
                stop = self._accepting.get(room)
                self._expire()
                record = RoomRecord(room, "", 0, 0, status=RoomStatus.FAILED)
                record.error = reason if stop else f"{reason} (before its Encode arrived)"
                self._records[room] = record
                self._move(record, RoomStatus.FAILED)
                if stop is None:
                    return Cancelled(False, None)
                stop.cancel(reason)
                return Cancelled(True, None)
            if record.status in FINAL:
                return Cancelled(True, None)
            task = record.task
            record.error = reason
            self._move(record, RoomStatus.FAILED)
            return Cancelled(True, task)

    def get(self, room: int) -> RoomRecord:
        with self._cond:
            record = self._records.get(room)
            if record is None:
                raise UnknownRoom(room)
            return record

    def wait(self, room: int, at_least: RoomStatus, timeout_s: float) -> RoomRecord:
        """The record once its status reaches ``at_least`` (or FAILED), or at the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                record = self._records.get(room)
                if record is None:
                    raise UnknownRoom(room)
                if record.status >= at_least:
                    return record
                left = deadline - time.monotonic()
                if left <= 0:
                    return record
                self._cond.wait(left)

    def encoded(self) -> list[tuple[int, EncodedPrompt, float, int]]:
        """(room, rows, deadline, rows already shipped or -1) of the rooms waiting for transfer
        blocks (or for their last rows to be handed over), oldest first."""
        with self._cond:
            live = self._live[RoomStatus.ENCODED].values()
            return [
                (r.room, r.encoded, r.deadline, r.num_rows_shipped)
                for r in live
                if r.encoded is not None
            ]

    def partially_encoded(self) -> list[RoomRecord]:
        """QUEUED rooms shipped image by image whose first images are encoded."""
        with self._cond:
            live = self._live[RoomStatus.QUEUED].values()
            return [
                r
                for r in live
                if r.prompt is not None and r.task is not None and r.task.has_first_rows
            ]

    def shipped_rows(self, room: int, num_rows: int) -> None:
        """Record that the first ``num_rows`` rows of a live room went to the sender."""
        with self._cond:
            record = self._records.get(room)
            if record is not None and record.status not in FINAL:
                record.num_rows_shipped = num_rows

    def submitted(self) -> list[tuple[int, float]]:
        """(room, deadline) of the rooms the sender holds."""
        with self._cond:
            return [(r.room, r.deadline) for r in self._live[RoomStatus.SUBMITTED].values()]

    def rooms_with(self, status: RoomStatus) -> list[int]:
        """The ids of the rooms in ``status`` now."""
        with self._cond:
            return [r.room for r in self._records.values() if r.status == status]

    def num_in(self, status: RoomStatus) -> int:
        """Live rooms in ``status`` (QUEUED, ENCODED or SUBMITTED)."""
        with self._cond:
            return len(self._live[status])

    def num_active(self) -> int:
        with self._cond:
            return self._num_active()

    def _check_free(self, room: int) -> None:
        """ValueError when ``room``'s id is in use (lock held)."""
        if room in self._accepting:
            raise ValueError(f"room {room} is already in use (being accepted)")
        known = self._records.get(room)
        if known is not None:
            why = f": {known.error}" if known.error else ""
            raise ValueError(f"room {room} is already in use ({known.status.name}{why})")

    def _num_active(self) -> int:
        return sum(len(self._live[status]) for status in ACTIVE)

    def _move(self, record: RoomRecord, status: RoomStatus) -> None:
        """Set ``status`` and drop what the room held in the states it left (lock held)."""
        self._live.get(record.status, {}).pop(record.room, None)
        record.status = status
        if status in self._live:
            self._live[status][record.room] = record
        if status != RoomStatus.QUEUED:
            record.task = record.prompt = None
        if status != RoomStatus.ENCODED:
            record.encoded = None
        if status in FINAL:
            record.finished_at = time.monotonic()
            self._finished[record.room] = record.finished_at
        self._cond.notify_all()

    def _expire(self) -> None:
        """Forget final rooms past the TTL, oldest first, and beyond ``max_finished``."""
        now = time.monotonic()
        while self._finished:
            room, finished_at = next(iter(self._finished.items()))
            if now - finished_at <= self._ttl_s and len(self._finished) <= self._max_finished:
                break
            del self._finished[room]
            self._records.pop(room, None)
