"""Accepted requests by room id: their status, for ``WaitEncoded`` and the load report.

A record moves forward only (``RoomStatus``); FAILED is final. Finished records are kept
``ttl_s`` seconds so a late ``WaitEncoded`` still gets the outcome, then forgotten.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from .errors import UnknownRoom
from .types import RoomStatus

FINAL = (RoomStatus.SHIPPED, RoomStatus.FAILED)


@dataclass
class RoomRecord:
    room: int
    request_id: str
    num_tokens: int
    num_images: int
    status: RoomStatus = RoomStatus.QUEUED
    error: str = ""
    num_cache_hits: int = 0
    encode_s: float = 0.0
    accepted_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None


class RoomTable:
    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._records: dict[int, RoomRecord] = {}
        self._cond = threading.Condition()

    def add(self, record: RoomRecord, max_active: int) -> bool:
        """Register ``record``; False when ``max_active`` rooms are still being encoded.

        Raises ValueError when the room id is already live.
        """
        with self._cond:
            self._expire()
            if record.room in self._records:
                raise ValueError(f"room {record.room} is already in use")
            if self.num_active_locked() >= max_active:
                return False
            self._records[record.room] = record
            return True

    def discard(self, room: int) -> None:
        with self._cond:
            self._records.pop(room, None)

    def update(self, room: int, status: RoomStatus, error: str = "", **fields) -> None:
        """Move ``room`` forward to ``status`` (ignored when not forward or the room is gone)."""
        with self._cond:
            record = self._records.get(room)
            if record is None or record.status == RoomStatus.FAILED:
                return
            if status < record.status and status != RoomStatus.FAILED:
                return
            record.status = status
            record.error = error or record.error
            for name, value in fields.items():
                setattr(record, name, value)
            if status in FINAL:
                record.finished_at = time.monotonic()
            self._cond.notify_all()

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

    def rooms_with(self, status: RoomStatus) -> list[int]:
        with self._cond:
            return [r.room for r in self._records.values() if r.status == status]

    def num_active(self) -> int:
        with self._cond:
            return self.num_active_locked()

    def num_active_locked(self) -> int:
        active = (RoomStatus.QUEUED, RoomStatus.ENCODED)
        return sum(r.status in active for r in self._records.values())

    def _expire(self) -> None:
        now = time.monotonic()
        stale = [
            room
            for room, r in self._records.items()
            if r.finished_at is not None and now - r.finished_at > self._ttl_s
        ]
        for room in stale:
            del self._records[room]
