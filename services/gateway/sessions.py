"""The gateway's sessions with its language workers: every request on one stream per worker.

A language worker streams the chunks of all the requests a gateway sent it on one stream, one
message per engine step (``LanguageService.Open``; the worker's side is
``services/language/sessions.py``), instead of a ``Generate`` stream per request: per token,
a message per request cost more CPU on both sides than the model's step takes on a small
machine. ``SessionSlot`` (one per worker channel, made with its stubs) opens the session on
first use and again after it broke; ``LanguageSession`` reads the stream on a thread of its own
and hands each chunk to its request's ``SessionCall``.

``SessionCall`` is used exactly as the ``Generate`` call it replaces: ``Submit`` starts at once
(a future), its refusal or the session's failure is raised by the first ``next`` as a
``grpc.RpcError`` with the worker's status, chunks follow, a chunk with ``status_code`` ends it
with that status, ``cancel()`` aborts the request on the worker (``Abort``) unless it ended,
and the request's deadline ends it with ``DEADLINE_EXCEEDED`` (and aborts it there).

A worker that does not know sessions (``UNIMPLEMENTED``: an older one in a rolling upgrade) is
served through ``Generate`` from then on. With a ``LingeringChannel`` (``lingering.py``) each
call holds the channel from its submit to its end, and the session's own stream does not: a
worker that left the pool keeps its channel until its last request ended, then the channel's
close ends the session.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from protos.epd.v1 import language_pb2

logger = logging.getLogger(__name__)
OPEN_TIMEOUT_S = 10.0  # the worker answers an Open at once; longer means it is not there
STATUS_OF_CODE = {code.value[0]: code for code in grpc.StatusCode}


class SessionError(grpc.RpcError):
    """A request's end with a status, as its gRPC call would have raised it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _error_of(exc: BaseException) -> SessionError:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return SessionError(exc.code(), exc.details() or "")
    return SessionError(grpc.StatusCode.UNAVAILABLE, f"{type(exc).__name__}: {exc}")


class SessionCall:
    """One request in a session; iterate its ``LanguageGenerateChunk``s (see the module)."""

    def __init__(
        self,
        session: LanguageSession,
        request_id: str,
        deadline: float,
        release: Callable[[], None],
    ) -> None:
        self.request_id = request_id
        self._session = session
        self._deadline = deadline
        self._release = release  # gives back the channel's hold, once, at the end
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ended = False
        self._submitted: grpc.Future | None = None  # the Submit call, once sent
        self._checked = False  # whether next() looked at the Submit's answer

    def submit(self, request: language_pb2.LanguageGenerateRequest) -> None:
        """Send ``Submit``; a failure ends the call."""
        try:
            self._submitted = self._session.rpcs.submit.future(request, timeout=self._remaining())
        except (grpc.RpcError, ValueError) as exc:  # ValueError: the channel closed
            self.fail(_error_of(exc))

    def _remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def __iter__(self) -> SessionCall:
        return self

    def __next__(self) -> language_pb2.LanguageGenerateChunk:
        submitted = self._submitted
        if submitted is not None and not self._checked:  # the first next: was it taken?
            self._checked = True
            try:
                submitted.result(timeout=self._remaining())
            except grpc.RpcError as exc:
                self.fail(_error_of(exc))
            except Exception:  # cancelled or timed out: the queue says what follows
                pass
        try:
            item = self._chunks.get(timeout=self._remaining())
        except queue.Empty:
            self.cancel()  # the worker drops it too
            raise SessionError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded") from None
        if item is None:
            raise StopIteration
        if isinstance(item, SessionError):
            raise item
        if item.status_code:
            self._end()
            raise SessionError(STATUS_OF_CODE[item.status_code], item.error)
        return item

    def deliver(self, chunk: language_pb2.LanguageGenerateChunk) -> None:
        """The session's reader thread: the next chunk of this request."""
        self._chunks.put(chunk)
        if chunk.last and not chunk.status_code and self._end():
            self._chunks.put(None)

    def fail(self, error: SessionError) -> None:
        """End the call with ``error`` (the next ``next`` raises it) unless it ended."""
        if self._end():
            self._chunks.put(error)

    def cancel(self) -> bool:
        """Abort the request on the worker unless it ended; wakes a waiting ``next``."""
        submitted = self._submitted
        if not self._end():
            return False
        if submitted is not None and not submitted.done():
            # Submit and Abort may overtake each other: abort once Submit was answered
            submitted.add_done_callback(lambda _f: self._session.abort(self.request_id))
        else:
            self._session.abort(self.request_id)
        self._chunks.put(SessionError(grpc.StatusCode.CANCELLED, "cancelled"))
        return True

    def _end(self) -> bool:
        """Mark the call ended; True for the caller that ended it (exactly once)."""
        with self._lock:
            if self._ended:
                return False
            self._ended = True
        self._session.forget(self.request_id)
        self._release()
        return True


@dataclass(frozen=True)
class SessionRpcs:
    """A language worker's session methods, made on its channel when the channel is made
    (grpcio must not make them on a channel closed meanwhile): on the channel itself, not held
    by any call (see the module)."""

    open: Any
    submit: Any
    abort: Any

    @classmethod
    def create(cls, channel) -> SessionRpcs:
        channel = getattr(channel, "unheld", channel)
        service = "/epd.v1.LanguageService/"
        return cls(
            channel.unary_stream(
                service + "Open",
                request_serializer=language_pb2.LanguageSessionRequest.SerializeToString,
                response_deserializer=language_pb2.LanguageOutputs.FromString,
            ),
            channel.unary_unary(
                service + "Submit",
                request_serializer=language_pb2.LanguageGenerateRequest.SerializeToString,
                response_deserializer=language_pb2.LanguageSubmitReply.FromString,
            ),
            channel.unary_unary(
                service + "Abort",
                request_serializer=language_pb2.LanguageAbortRequest.SerializeToString,
                response_deserializer=language_pb2.LanguageAbortResponse.FromString,
            ),
        )


class LanguageSession:
    """One open session: its stream's reader thread and the calls in it."""

    def __init__(self, rpcs: SessionRpcs) -> None:
        self.session_id = secrets.token_hex(16)
        self.rpcs = rpcs
        self._lock = threading.Lock()
        self._calls: dict[str, SessionCall] = {}
        self._error: SessionError | None = None  # set once the stream ended
        self._opened = threading.Event()
        opening = language_pb2.LanguageSessionRequest(session_id=self.session_id)
        self._stream = rpcs.open(opening)  # ValueError when the channel is closed
        threading.Thread(target=self._read, name="language-session", daemon=True).start()

    @property
    def broken(self) -> bool:
        return self._error is not None

    def wait_open(self, timeout_s: float) -> SessionError | None:
        """None once the worker answered the Open; else what ended it."""
        if not self._opened.wait(timeout_s):
            return SessionError(
                grpc.StatusCode.UNAVAILABLE,
                f"no session opened within {timeout_s:.1f} s",
            )
        return self._error

    def submit(
        self, request: language_pb2.LanguageGenerateRequest, timeout_s: float, release
    ) -> SessionCall:
        """Start ``request`` in the session (``release()`` gives back the channel's hold when
        it ends: see the module)."""
        request.session_id = self.session_id
        request.timeout_s = timeout_s
        call = SessionCall(self, request.request_id, time.monotonic() + timeout_s, release)
        with self._lock:
            error = self._error
            if error is None:
                self._calls[request.request_id] = call
        if error is not None:
            call.fail(error)
        else:
            call.submit(request)
        return call

    def abort(self, request_id: str) -> None:
        """Best effort: the worker drops ``request_id`` (a failure is only logged)."""
        request = language_pb2.LanguageAbortRequest(request_id=request_id)
        try:
            future = self.rpcs.abort.future(request, timeout=OPEN_TIMEOUT_S)
        except (grpc.RpcError, ValueError):  # the channel closed: the worker drops it anyway
            return
        future.add_done_callback(lambda f: f.cancelled() or f.exception())

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._calls.pop(request_id, None)

    def _read(self) -> None:
        error = SessionError(grpc.StatusCode.UNAVAILABLE, "the session's stream ended")
        try:
            for message in self._stream:
                self._opened.set()
                calls = self._calls  # read without the lock: dict lookups are atomic
                for chunk in message.chunks:
                    call = calls.get(chunk.request_id)
                    if call is not None:
                        call.deliver(chunk)
        except grpc.RpcError as exc:
            error = _error_of(exc)
        except Exception:  # a defect here must still end every call
            logger.exception("language session reader failed")
        self._end(error)

    def _end(self, error: SessionError) -> None:
        error = SessionError(error.code(), f"session stream: {error.details()}")
        with self._lock:
            self._error = error
            calls, self._calls = list(self._calls.values()), {}
        self._opened.set()
        for call in calls:
            call.fail(error)


class SessionSlot:
    """A language worker channel's current session: opened on first use, again after it
    broke; made with the channel (``registry.create_stubs``)."""

    def __init__(self, channel) -> None:
        self._channel = channel
        self._rpcs = SessionRpcs.create(channel)
        self._lock = threading.Lock()
        self._session: LanguageSession | None = None
        self.supported = True  # False once the worker answered Open with UNIMPLEMENTED

    def submit(
        self, request: language_pb2.LanguageGenerateRequest, timeout_s: float
    ) -> SessionCall | None:
        """Start ``request`` on the worker; None when it does not know sessions (use
        ``Generate``). A session that cannot open makes a call that raises why; ValueError
        when the channel is closed."""
        session = self._current()
        error = session.wait_open(min(timeout_s, OPEN_TIMEOUT_S))
        if error is not None and error.code() == grpc.StatusCode.UNIMPLEMENTED:
            self.supported = False
            return None
        return session.submit(request, timeout_s, self._hold())

    def _current(self) -> LanguageSession:
        with self._lock:
            if self._session is None or self._session.broken:
                self._session = LanguageSession(self._rpcs)
            return self._session

    def _hold(self) -> Callable[[], None]:
        """Hold the channel for a call (ValueError when it is closed); returns the release."""
        hold = getattr(self._channel, "hold", None)
        return hold() if hold is not None else _nothing


def _nothing() -> None:
    pass
