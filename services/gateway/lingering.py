"""A worker's channel that outlives the worker's removal from the registry until its calls end.

The registry closes a worker's channel when the worker leaves (``Deregister`` at the start of
its drain) or goes silent. Closing a grpcio channel ends every call on it at once, so a draining
worker would lose the streams it is still serving. ``LingeringChannel`` defers that close: once
``close()`` was called, a new call is refused the way a closed channel refuses it (``ValueError``
at once, which ``workers.py`` turns into ``WorkerGone``), and the underlying channel closes when
the last call in flight ends (its done-callback). A worker that is really gone ends those calls
itself (the transport fails them), so nothing lingers for long; one that went silent (expired:
dead, hung or cut off) has its calls ended at once by ``abort()``.

Invariant: every call started through the channel is counted once and uncounted exactly once,
by its done-callback; the underlying channel is closed exactly once, when closing and no call
is in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc


class _Blocking:
    """A unary-response multicallable: a blocking call counts while it runs, a future until
    it is done."""

    def __init__(self, owner: LingeringChannel, inner) -> None:
        self._owner = owner
        self._inner = inner

    def __call__(self, *args, **kwargs):
        self._owner._enter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self._owner._leave()

    def with_call(self, *args, **kwargs):
        self._owner._enter()
        try:
            return self._inner.with_call(*args, **kwargs)
        finally:
            self._owner._leave()

    def future(self, *args, **kwargs):
        return self._owner._track(lambda: self._inner.future(*args, **kwargs))


class _Streaming:
    """A response-streaming multicallable: the call counts until it is done."""

    def __init__(self, owner: LingeringChannel, inner) -> None:
        self._owner = owner
        self._inner = inner

    def __call__(self, *args, **kwargs):
        return self._owner._track(lambda: self._inner(*args, **kwargs))


class LingeringChannel(grpc.Channel):
    """Wraps ``inner``; ``close()`` takes effect once no call is in flight."""

    def __init__(self, inner: grpc.Channel) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._num_calls = 0
        self._closing = False
        self._closed = False

    @property
    def num_calls(self) -> int:
        """Calls in flight on the channel."""
        with self._lock:
            return self._num_calls

    @property
    def closed(self) -> bool:
        """Whether the underlying channel is closed."""
        with self._lock:
            return self._closed

    @property
    def unheld(self) -> grpc.Channel:
        """The channel itself: calls made on it are not counted (a session's stream, whose
        requests ``hold`` the channel instead: ``sessions.py``)."""
        return self._inner

    def hold(self) -> Callable[[], None]:
        """Count one call in flight until the returned release is called (once; later calls
        do nothing); ``ValueError`` once closing, as a new call gets."""
        self._enter()
        held = [True]

        def release() -> None:
            try:
                held.pop()  # atomic: only the first release gets past it
            except IndexError:
                return
            self._leave()

        return release

    def _enter(self) -> None:
        with self._lock:
            if self._closing:
                raise ValueError("Cannot invoke RPC: Channel closed!")
            self._num_calls += 1

    def _track(self, start):
        """Start a call with ``start()`` and count it until its done-callback runs."""
        self._enter()
        try:
            call = start()
        except BaseException:
            self._leave()
            raise
        call.add_done_callback(lambda _call: self._leave())
        return call

    def _leave(self) -> None:
        with self._lock:
            self._num_calls -= 1
            close_now = self._closing and self._num_calls == 0 and not self._closed
            self._closed = self._closed or close_now
        if close_now:
            # NOTE: the last call's done-callback runs on a grpc thread; closing the channel
            # from inside its own callback is not safe, so it is closed from a thread of its own.
            threading.Thread(target=self._inner.close, name="channel-close", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            close_now = self._num_calls == 0 and not self._closed
            self._closed = self._closed or close_now
        if close_now:
            self._inner.close()

    def abort(self) -> None:
        """Close now, ending every call in flight (``CANCELLED``, "Channel closed!"): for a
        worker that went silent, whose calls would only stall until the transport notices."""
        with self._lock:
            self._closing = True
            close_now = not self._closed
            self._closed = True
        if close_now:
            self._inner.close()

    def _close(self) -> None:
        self.close()

    def __enter__(self) -> LingeringChannel:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False

    def subscribe(self, callback, try_to_connect=False):
        self._inner.subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback):
        self._inner.unsubscribe(callback)

    def unary_unary(self, method, *args, **kwargs):
        return _Blocking(self, self._inner.unary_unary(method, *args, **kwargs))

    def unary_stream(self, method, *args, **kwargs):
        return _Streaming(self, self._inner.unary_stream(method, *args, **kwargs))

    def stream_unary(self, method, *args, **kwargs):
        return _Blocking(self, self._inner.stream_unary(method, *args, **kwargs))

    def stream_stream(self, method, *args, **kwargs):
        return _Streaming(self, self._inner.stream_stream(method, *args, **kwargs))
