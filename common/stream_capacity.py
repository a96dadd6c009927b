"""A bound on a server's long RPCs, so health and short calls always find a thread.

grpcio's sync server runs every call on one thread pool. A streaming call holds its thread for
the whole stream; with as many streams as threads, a ``grpc.health.v1`` check, a ``GetLoad`` or
an ``Abort`` waits in the pool's queue behind them — the gateway then flaps the worker and a
kubelet probe restarts the pod. ``StreamCapacity`` names the long methods and how many may run
at once; the server's pool is ``max_streams + reserve`` threads, and
``StreamCapacityInterceptor`` ends a long call beyond ``max_streams`` at once with
``RESOURCE_EXHAUSTED`` ("<who> at its stream capacity N"), so at least ``reserve`` threads
always remain for everything else.

Invariant: a slot is taken on the pool thread that runs the call, and given back exactly once
when that call's behavior returns or raises (for a response stream: when its generator ends,
is closed by grpcio after a cancellation, or is collected) — a call grpcio never starts never
takes one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from common.rpc_handlers import with_behavior

RESERVE_THREADS = 8


@dataclass(frozen=True)
class StreamCapacity:
    """How many long calls a server runs at once, and which methods are long."""

    max_streams: int  # long calls at once; more get RESOURCE_EXHAUSTED
    methods: tuple[str, ...] = ()  # full names, "/epd.v1.LanguageService/Generate"
    reserve: int = RESERVE_THREADS  # pool threads beyond max_streams, for the short calls
    who: str = "server"  # names the server in the RESOURCE_EXHAUSTED message
    on_reject: Callable[[str], None] | None = None  # called with the method of a refused call
    message: str = ""  # the RESOURCE_EXHAUSTED message ("" = "<who> at its stream capacity N")

    def __post_init__(self) -> None:
        if self.max_streams < 0 or self.reserve < 1:
            raise ValueError(
                f"stream capacity needs max_streams >= 0 and reserve >= 1, got "
                f"{self.max_streams} and {self.reserve}"
            )
        if self.methods and self.max_streams < 1:
            raise ValueError(f"{self.who}: long methods need max_streams >= 1")

    @property
    def num_threads(self) -> int:
        return self.max_streams + self.reserve

    @property
    def refusal(self) -> str:
        default = f"{self.who} at its stream capacity {self.max_streams}: retry later or elsewhere"
        return self.message or default


class StreamCapacityInterceptor(grpc.ServerInterceptor):
    def __init__(self, capacity: StreamCapacity) -> None:
        self._capacity = capacity
        self._methods = frozenset(capacity.methods)
        self._lock = threading.Lock()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        """Long calls running now."""
        return self._in_flight

    def _acquire(self) -> bool:
        with self._lock:
            if self._in_flight >= self._capacity.max_streams:
                return False
            self._in_flight += 1
            return True

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _refuse(self, method: str, context: grpc.ServicerContext) -> None:
        if self._capacity.on_reject is not None:
            self._capacity.on_reject(method)
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._capacity.refusal)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self._methods:
            return handler

        def bounded(behavior: Callable, response_streaming: bool) -> Callable:
            if response_streaming:

                def stream(request, context):
                    if not self._acquire():
                        self._refuse(method, context)
                    try:
                        yield from behavior(request, context)
                    finally:
                        self._release()

                return stream

            def unary(request, context):
                if not self._acquire():
                    self._refuse(method, context)
                try:
                    return behavior(request, context)
                finally:
                    self._release()

            return unary

        return with_behavior(handler, bounded)
