"""Bounded admission and the table of requests in flight (for Abort).

A request is admitted only while fewer than ``max_queued`` are in flight; beyond that the
gateway answers RESOURCE_EXHAUSTED at once instead of queueing without bound. Each admitted
request registers the calls it made on workers so that ``Abort`` (or the client going away)
cancels all of them.

The table is keyed by the client's request id (one is drawn when the client sends none): a
second request with the id of a live one is refused (``DuplicateRequest``) and the live one is
untouched. Each entry remembers its owner, the caller's identity (``servicer.caller_identity``):
``abort`` only reaches a request of the same owner, and to anyone else such a request does not
exist. The ids the gateway uses with workers are its own (``orchestrator.new_call_id``).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


def queue_full_message(max_queued: int) -> str:
    """What a caller is told when ``max_queued`` requests are already in flight."""
    return f"gateway queue is full ({max_queued} requests in flight)"


class QueueFull(Exception):
    pass


class DuplicateRequest(Exception):
    pass


@dataclass
class Admitted:
    """One request in flight."""

    request_id: str
    owner: str = ""  # who may abort it: a hashed API key or the caller's peer address
    admitted_at: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    _cancels: list[Callable[[], object]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _closed: bool = False

    def wait_cancelled(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s``; True as soon as the request is cancelled."""
        return self._cancelled.wait(timeout_s)

    def on_cancel(self, cancel: Callable[[], object]) -> None:
        """Register a call's cancel; runs at once if the request is already cancelled."""
        with self._lock:
            if not self.cancelled:
                self._cancels.append(cancel)
                return
        cancel()

    def close(self) -> None:
        """The final chunk is on its way to the client: nothing may cancel the request now
        (an Abort that comes later finds no request), so it ends with one terminal status."""
        with self._lock:
            self._closed = True

    def cancel(self) -> bool:
        """Cancel everything the request started; False when it was already closed."""
        with self._lock:
            if self._closed:
                return False
            self.cancelled = True
            cancels, self._cancels = self._cancels, []
        self._cancelled.set()
        for cancel in cancels:
            cancel()
        return True


class Admission:
    def __init__(self, max_queued: int) -> None:
        self._max = max_queued
        self._lock = threading.Lock()
        self._in_flight: dict[str, Admitted] = {}

    def admit(self, request_id: str = "", owner: str = "") -> Admitted:
        request_id = request_id or secrets.token_hex(16)
        with self._lock:
            if request_id in self._in_flight:
                raise DuplicateRequest(f"request id {request_id!r} is already in flight")
            if len(self._in_flight) >= self._max:
                raise QueueFull(queue_full_message(self._max))
            admitted = self._in_flight[request_id] = Admitted(request_id, owner)
        return admitted

    def finish(self, admitted: Admitted) -> None:
        with self._lock:
            if self._in_flight.get(admitted.request_id) is admitted:
                del self._in_flight[admitted.request_id]

    def abort(self, request_id: str, owner: str = "") -> bool:
        """Cancel the live request ``request_id`` of ``owner``; False when there is none."""
        with self._lock:
            admitted = self._in_flight.get(request_id)
        if admitted is None or admitted.owner != owner:
            return False
        return admitted.cancel()

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)
