"""The main thread's wait for SIGTERM/SIGINT, whichever thread of the process takes the signal.

NOTE: CPython runs a signal's Python handler in the main thread only, once that thread executes
bytecode again; the C handler, in whatever thread the kernel chose, only sets a flag. A process-
directed signal may go to any thread that does not block it (and a thread-directed one goes to
that thread), so a main thread blocked in ``threading.Event.wait()`` can sleep through its
SIGTERM while a gRPC or pool thread took it: the process then never drains nor exits. Here the
main thread blocks reading a pipe that is also the interpreter's wakeup fd
(``signal.set_wakeup_fd``): the C handler writes the signal's number into it from any thread,
which wakes the read. The numbers read are the signals received, so nothing depends on when the
Python handler itself runs (it does nothing), and it takes no lock that the code it interrupts
might hold. ``wake()`` ends a wait from another thread the same way (byte 0: no signal has it).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from types import TracebackType

WAKE = 0  # the byte ``wake`` writes; signal numbers start at 1


def _ignore(_signum: int, _frame: object) -> None:
    """The Python-level handler: the wakeup pipe already carries the signal."""


class TerminationSignals:
    """While entered (in the main thread), ``signals`` no longer end the process; ``next()``
    blocks until one arrives, however it was delivered. Leaving restores the previous handlers
    and wakeup fd."""

    def __init__(self, signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM)) -> None:
        self._signals = frozenset(int(s) for s in signals)
        self._read_fd = -1
        self._write_fd = -1
        self._previous: dict[int, object] = {}
        self._previous_wakeup_fd = -1

    def __enter__(self) -> TerminationSignals:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # set_wakeup_fd demands it; reads block
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for signum in self._signals:
            self._previous[signum] = signal.signal(signum, _ignore)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for signum, handler in self._previous.items():
            if handler is not None:  # None: a handler not set from Python, nothing to restore
                signal.signal(signum, handler)
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        os.close(self._read_fd)
        os.close(self._write_fd)

    def next(self) -> signal.Signals | None:
        """Block until one of the signals arrives (returned) or ``wake()`` was called (None).
        Signals and wakes that came before this call are returned first, in order."""
        while True:
            # NOTE: one byte at a time, so that what follows stays in the pipe for the next call
            (byte,) = os.read(self._read_fd, 1)  # never EOF: we hold the write end
            if byte == WAKE:
                return None
            if byte in self._signals:
                return signal.Signals(byte)

    def wake(self) -> None:
        """End the current or next ``next()`` call with None (any thread)."""
        os.write(self._write_fd, bytes([WAKE]))
