"""When a request's synchronous work inside ``accept`` (a video's decode) stops early.

``EncoderService.accept`` makes one ``StopCheck`` per request: the request's deadline and a
cancellation flag that ``Encoder.Cancel`` sets from its own thread (through the ``RoomTable``,
which keeps the rooms being accepted). Long loops call ``check`` between steps
(``video_decode.decode_frames``: between two frames), which raises ``RequestCancelled`` once the
room was cancelled and ``DeadlineExpired`` once the deadline passed. A cancel wins over a passed
deadline: it is the caller's explicit word.
"""

from __future__ import annotations

import math
import threading
import time

from .errors import DeadlineExpired, RequestCancelled


class StopCheck:
    def __init__(self, deadline: float = math.inf) -> None:
        self.deadline = deadline  # time.monotonic(): the request's own
        self._cancelled = threading.Event()
        self._reason = ""

    def cancel(self, reason: str) -> None:
        """Stop the work at its next ``check`` (from any thread); the first reason is kept."""
        if not self._cancelled.is_set():
            self._reason = reason
            self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def reason(self) -> str:
        """Why the room was cancelled ("" while it was not)."""
        return self._reason if self._cancelled.is_set() else ""

    def check(self, doing: str) -> None:
        """Raise ``RequestCancelled`` or ``DeadlineExpired`` ("... while {doing}") when the work
        should stop; return otherwise."""
        if self._cancelled.is_set():
            raise RequestCancelled(f"{self._reason} while {doing}")
        if time.monotonic() > self.deadline:
            raise DeadlineExpired(f"the deadline passed while {doing}")
