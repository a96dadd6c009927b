"""Sessions: the outputs of many requests on one stream, one message per engine step.

A ``Generate`` call per request costs a gRPC message per token per request, and on this
server each message is a hand-off between the call's thread and grpcio's (~110 us of CPU,
most of it holding the GIL the engine thread needs between its kernels). A caller that serves
many requests (the gateway) opens one session per worker instead (``LanguageService.Open``),
submits requests to it (``Submit``) and gets, per engine step, one ``LanguageOutputs`` with
every request's chunk of that step.

A ``Session`` is the engine thread's sink for its requests (``put_all``: one step's outputs,
never blocks) and the stream's source (``batches``: blocks until outputs or the close).
``SessionTable`` holds the worker's open sessions by id. Closing a session (its stream ended:
the caller cancelled or went away) returns the requests still in it, which the servicer
aborts; a request is in it from ``track`` (before the engine sees it) until its last output
is sent (``sent``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from services.language.engine.request import RequestOutput


class SessionClosedError(RuntimeError):
    """The session's stream ended: it takes no more requests."""


@dataclass
class _Tracked:
    echo: str  # the prompt's text, for each choice's first chunk ("" without echo)
    echoed: set[int] = field(default_factory=set)  # choices whose first chunk went out


class Session:
    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._outputs: list[RequestOutput] = []
        self._requests: dict[str, _Tracked] = {}
        self._closed = False

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    def put_all(self, outputs: list[RequestOutput]) -> None:
        """The engine thread's outputs of one step for this session's requests."""
        with self._lock:
            self._outputs.extend(outputs)
            self._ready.notify()

    def batches(self) -> Iterator[list[RequestOutput]]:
        """Every output put since the last batch, as soon as there is one; ends at the close."""
        while True:
            with self._lock:
                while not (self._outputs or self._closed):
                    self._ready.wait()
                if self._closed:
                    return
                batch, self._outputs = self._outputs, []
            yield batch

    def track(self, request_id: str, echo: str = "") -> None:
        """``request_id`` is this session's until its last output is sent."""
        with self._lock:
            if self._closed:
                raise SessionClosedError(f"session {self.session_id} is closed")
            self._requests[request_id] = _Tracked(echo)

    def untrack(self, request_id: str) -> None:
        with self._lock:
            self._requests.pop(request_id, None)

    def sent(self, out: RequestOutput) -> str:
        """``out`` is being sent: returns the prompt's text when it is its choice's first chunk
        of a request with echo, else ""; forgets the request after its last output."""
        with self._lock:
            tracked = (
                self._requests.pop(out.request_id, None)
                if out.ends_request
                else self._requests.get(out.request_id)
            )
        if tracked is None or out.index in tracked.echoed:
            return ""
        tracked.echoed.add(out.index)
        return tracked.echo

    def close(self) -> list[str]:
        """End the stream (idempotent); returns the requests still in the session."""
        with self._lock:
            self._closed = True
            left, self._requests = list(self._requests), {}
            self._outputs.clear()
            self._ready.notify_all()
        return left


class SessionTable:
    """The worker's open sessions, by id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    def open(self, session_id: str) -> Session:
        """A new session; ValueError when the id is empty or already open."""
        if not session_id:
            raise ValueError("session_id is required")
        with self._lock:
            if session_id in self._sessions:
                raise ValueError(f"session {session_id!r} is already open")
            session = self._sessions[session_id] = Session(session_id)
        return session

    def get(self, session_id: str) -> Session | None:
        with self._lock:
            return self._sessions.get(session_id)

    def close(self, session: Session) -> list[str]:
        """Close ``session`` and drop it; returns the requests still in it."""
        with self._lock:
            if self._sessions.get(session.session_id) is session:
                del self._sessions[session.session_id]
        return session.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)
