"""What every gRPC server of the project shares: limits, capacity, security, health, signals.

``create_server`` builds a server whose thread pool has room for its long calls plus a reserve
(``common.stream_capacity``: long calls beyond the bound get ``RESOURCE_EXHAUSTED``, so health,
``GetLoad``, ``Abort`` and ``Cancel`` never wait behind streams), with optional security
(``ServerSecurity``: TLS and/or a bearer-secret interceptor; ``grpc.health.v1`` stays open) and
a drain gate on its work methods (``common.drain.DrainGate``).
``start_server`` adds health and reflection, binds and starts; with a ``health_port`` it also
serves ``grpc.health.v1`` alone, in plaintext, on a side server of its own (kubelet gRPC probes
speak neither TLS nor bearer tokens), which stops with the main one. Health answers liveness
(``""``) and readiness (``common.drain.READINESS``) apart.

``serve_until_terminated`` is the main thread of ``epd serve ROLE``: the first SIGTERM/SIGINT
starts the role's drain (``Running.drain``, bounded by ``Running.drain_timeout_s``) and stops
once it is over; a second signal stops at once. It waits through ``common.signals``, so a
signal taken by any thread of the process counts.

Ports are exclusive (``grpc.so_reuseport`` off): a busy port is an ``OSError`` naming it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.auth import BearerAuthInterceptor
from common.channels import DEFAULT_KEEPALIVE, Keepalive
from common.drain import DrainGate, Readiness
from common.heap import freeze_startup_heap
from common.signals import TerminationSignals
from common.stream_capacity import StreamCapacity, StreamCapacityInterceptor
from common.tls import ServerTLS

logger = logging.getLogger(__name__)
HEALTH_THREADS = 2


@dataclass(frozen=True)
class ServerSecurity:
    """What a server demands of its callers; both parts optional."""

    tls: ServerTLS | None = None  # None: plaintext
    auth: BearerAuthInterceptor | None = None  # None: no bearer secret needed

    @property
    def describe(self) -> str:
        parts = []
        if self.tls is not None:
            parts.append("mutual TLS" if self.tls.mutual else "TLS")
        if self.auth is not None:
            parts.append("bearer auth")
        return " + ".join(parts) or "plaintext, open"


class Server(grpc.Server):
    """A ``grpc.Server`` that remembers its security, gates its work methods for a drain,
    reports readiness and stops its health side server."""

    def __init__(
        self,
        inner: grpc.Server,
        name: str,
        security: ServerSecurity | None,
        capacity: StreamCapacityInterceptor | None,
        gate: DrainGate | None = None,
    ) -> None:
        self._inner = inner
        self.name = name
        self.security = security or ServerSecurity()
        self.capacity = capacity
        self.gate = gate  # None: no work methods to refuse while draining
        self.readiness: Readiness | None = None  # set by start_server
        self.health_server: grpc.Server | None = None

    def add_generic_rpc_handlers(self, generic_rpc_handlers):
        self._inner.add_generic_rpc_handlers(generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name, method_handlers):
        self._inner.add_registered_method_handlers(service_name, method_handlers)

    def add_insecure_port(self, address: str) -> int:
        return self._inner.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        return self._inner.add_secure_port(address, server_credentials)

    def start(self) -> None:
        self._inner.start()

    def stop(self, grace: float | None) -> threading.Event:
        if self.health_server is not None:
            self.health_server.stop(grace)
        return self._inner.stop(grace)

    def stop_accepting(self, grace: float) -> threading.Event:
        """Stop the main port only: no new calls (clients get GOAWAY and reconnect elsewhere),
        the calls in flight go on for up to ``grace`` seconds; the health side server keeps
        answering probes. The event is set once every call ended. A call that races the GOAWAY
        (sent before the client had it) is cancelled by gRPC (``CANCELLED``); later ones find
        the port closed (``UNAVAILABLE``)."""
        return self._inner.stop(grace)

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._inner.wait_for_termination(timeout)


def _grpc_server(
    num_threads: int,
    thread_name: str,
    max_message_mb: int,
    interceptors=(),
    keepalive: Keepalive = DEFAULT_KEEPALIVE,
):
    """NOTE: grpcio sets ``SO_REUSEPORT`` by default, so a second server binds a port already in
    use and the kernel splits connections between the two. Ports here are exclusive."""
    max_bytes = max_message_mb << 20
    return grpc.server(
        futures.ThreadPoolExecutor(num_threads, thread_name_prefix=thread_name),
        interceptors=list(interceptors),
        options=[
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_send_message_length", max_bytes),
            ("grpc.so_reuseport", 0),
            *keepalive.server_options(),
        ],
    )


def create_server(
    name: str,
    max_message_mb: int,
    capacity: StreamCapacity,
    security: ServerSecurity | None = None,
    work_methods: Sequence[str] = (),
    keepalive: Keepalive = DEFAULT_KEEPALIVE,
) -> Server:
    """A server whose messages may be ``max_message_mb`` large (images are MBs), running at most
    ``capacity.max_streams`` long calls on a pool of ``capacity.num_threads`` threads.

    ``work_methods`` (full names) are the calls a drain refuses and waits for. ``keepalive``:
    how the server pings its callers (a caller cut off ends its calls, freeing what they hold)
    and how often it lets them ping it."""
    interceptors: list[grpc.ServerInterceptor] = []
    if security is not None and security.auth is not None:
        interceptors.append(security.auth)  # first: refused calls take no stream slot
    gate = DrainGate(work_methods, capacity.who) if work_methods else None
    if gate is not None:
        interceptors.append(gate)  # before the bound: a refused call takes no stream slot
    bound = StreamCapacityInterceptor(capacity) if capacity.methods else None
    if bound is not None:
        interceptors.append(bound)
    inner = _grpc_server(
        capacity.num_threads, f"{name}-rpc", max_message_mb, interceptors, keepalive
    )
    return Server(inner, name, security, bound, gate)


def _bind(server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"cannot bind gRPC port {address}: in use or not available")
    return bound


def start_server(
    server: Server,
    host: str,
    port: int,
    service_names: Sequence[str],
    health_port: int = 0,
    ready: bool = True,
) -> tuple[int, health.HealthServicer]:
    """Add grpc.health.v1 and reflection, bind, start. Liveness (``""``) reports SERVING;
    readiness and ``service_names`` too, unless ``ready`` is False (``server.readiness.set``
    turns them on later).

    Returns the bound port (``port`` 0 picks one) and the health servicer (it also answers on
    ``health_port`` when that is set).
    """
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    tls = server.security.tls
    bound = _bind(server, f"{host}:{port}", tls.credentials() if tls is not None else None)
    if health_port:
        side = _grpc_server(HEALTH_THREADS, f"{server.name}-health", 1)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, side)
        try:
            _bind(side, f"{host}:{health_port}", None)
        except OSError:
            server.stop(None)
            raise
        server.health_server = side
    server.start()
    if server.health_server is not None:
        server.health_server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    server.readiness = Readiness(health_servicer, service_names)
    server.readiness.set(ready)
    return bound, health_servicer


@dataclass(frozen=True)
class Running:
    """A started service (``start(args)`` of a server module): its port, a line that says where
    it listens, how to drain it and how to stop everything it started. A gateway also has its
    registry port.

    ``drain(deadline)`` (``time.monotonic`` clock) stops taking new work and returns once the
    work in flight is done (True) or at the deadline (False); ``stop()`` then ends the rest."""

    port: int
    banner: str
    stop: Callable[[], object]
    registry_port: int = 0
    drain: Callable[[float], bool] | None = None
    drain_timeout_s: float = 0.0


def serve_until_terminated(start: Callable[[], Running]) -> int:
    """The main thread of ``epd serve ROLE``: start (SIGINT/SIGTERM already caught: one that
    comes while the worker registers or loads is honoured once it started, by a drain, never
    by dying registered), freeze the start-up heap (``common.heap``), announce, block until
    SIGINT/SIGTERM, drain (up to ``running.drain_timeout_s``; a second signal cuts it short),
    stop."""
    with TerminationSignals() as signals:
        running = start()
        freeze_startup_heap()
        print(running.banner, flush=True)
        signals.next()  # nothing wakes it before a drain starts: a signal
        if running.drain is not None and running.drain_timeout_s > 0:
            deadline = time.monotonic() + running.drain_timeout_s
            logger.info("stopping: draining for up to %.0f s", running.drain_timeout_s)

            def drain() -> None:
                try:
                    running.drain(deadline)
                except Exception:  # the stop below still runs
                    logger.exception("drain failed")
                finally:
                    signals.wake()

            threading.Thread(target=drain, name="drain", daemon=True).start()
            again = signals.next()  # the drain ended (None), or a second signal came
            if again is not None:
                logger.warning("%s again: stopping now", again.name)
        running.stop()
    return 0
