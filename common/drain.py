"""Graceful drain of a server: readiness off, new work refused, the work in flight awaited.

Every server answers ``grpc.health.v1`` for two names that probes tell apart:

* ``""`` — liveness: SERVING from start-up until the process stops its servers, drain included
  (a kubelet liveness probe must not restart a pod that is finishing its requests);
* ``READINESS`` (``"epd.readiness"``) — readiness: SERVING while the server takes new work,
  NOT_SERVING from the first moment of a drain (or until the server is ready, see
  ``Readiness.set``). The role's own service names (``epd.v1.LanguageService``, ...) follow it.

``DrainGate`` is a server interceptor on a server's *work* methods (a language worker's
``Generate``, an encoder's ``Encode``, the gateway's ``Generate``): it counts the calls in flight
and, once closed, ends every new one at once with ``UNAVAILABLE`` ("<who> is draining: retry on
another"), so the gateway's encoder retry and the client's retry move on. Every other method
(health, ``GetLoad``, ``Cancel``, ``Abort``) keeps answering to the end.

Invariant: a work call counts from the moment the pool thread starts it until its behavior
returns or raises (a response stream: until its generator ends or is closed), exactly once;
``wait_idle`` blocks on a condition notified when the count reaches zero (no polling).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2

from common.rpc_handlers import with_behavior

READINESS = "epd.readiness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class DrainGate(grpc.ServerInterceptor):
    """Counts the calls of ``methods`` in flight; once ``close()``d, refuses new ones."""

    def __init__(self, methods: Sequence[str], who: str) -> None:
        self._methods = frozenset(methods)
        self._who = who
        self._cond = threading.Condition()
        self._num_in_flight = 0
        self._closed = False

    @property
    def refusal(self) -> str:
        return f"{self._who} is draining: retry on another"

    @property
    def num_in_flight(self) -> int:
        with self._cond:
            return self._num_in_flight

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def close(self) -> None:
        """Refuse every work call from now on (the calls in flight go on)."""
        with self._cond:
            self._closed = True

    def wait_idle(self, deadline: float) -> bool:
        """Block until no work call is in flight (True) or ``deadline`` (``time.monotonic``)
        passes (False)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._num_in_flight == 0, max(0.0, deadline - time.monotonic())
            )

    def _enter(self) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._num_in_flight += 1
            return True

    def _leave(self) -> None:
        with self._cond:
            self._num_in_flight -= 1
            if self._num_in_flight == 0:
                self._cond.notify_all()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self._methods:
            return handler

        def gated(behavior: Callable, response_streaming: bool) -> Callable:
            if response_streaming:

                def stream(request, context):
                    if not self._enter():
                        context.abort(grpc.StatusCode.UNAVAILABLE, self.refusal)
                    try:
                        yield from behavior(request, context)
                    finally:
                        self._leave()

                return stream

            def unary(request, context):
                if not self._enter():
                    context.abort(grpc.StatusCode.UNAVAILABLE, self.refusal)
                try:
                    return behavior(request, context)
                finally:
                    self._leave()

            return unary

        return with_behavior(handler, gated)


class Readiness:
    """The readiness a server reports through its health servicer (``READINESS`` and the
    role's service names). Once ``drain()`` was called it stays NOT_SERVING."""

    def __init__(self, servicer: health.HealthServicer, service_names: Sequence[str]) -> None:
        self._servicer = servicer
        self._names = (READINESS, *service_names)
        self._lock = threading.Lock()
        self._draining = False
        self._ready = False

    @property
    def ready(self) -> bool:
        """What the health servicer says now (other front doors report the same)."""
        return self._ready

    @property
    def draining(self) -> bool:
        return self._draining

    def set(self, ready: bool) -> None:
        """Ready (SERVING) or not; a no-op once draining."""
        with self._lock:
            if self._draining:
                return
            self._set(SERVING if ready else NOT_SERVING)

    def drain(self) -> None:
        """NOT_SERVING for good: the drain started."""
        with self._lock:
            self._draining = True
            self._set(NOT_SERVING)

    def _set(self, status: int) -> None:
        self._ready = status == SERVING
        for name in self._names:
            self._servicer.set(name, status)
