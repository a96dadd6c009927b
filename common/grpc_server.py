"""What every gRPC server of the project shares: message limits, health, reflection, signals."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


def create_server(num_threads: int, max_message_mb: int, name: str) -> grpc.Server:
    """A server whose messages may be ``max_message_mb`` large (images are MBs).

    NOTE: grpcio sets ``SO_REUSEPORT`` by default, so a second server binds a port already in
    use and the kernel splits connections between the two. Ports here are exclusive: a busy
    port is a start-up error.
    """
    max_bytes = max_message_mb << 20
    return grpc.server(
        futures.ThreadPoolExecutor(num_threads, thread_name_prefix=f"{name}-rpc"),
        options=[
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_send_message_length", max_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )


def start_server(
    server: grpc.Server, host: str, port: int, service_names: Sequence[str]
) -> tuple[int, health.HealthServicer]:
    """Add grpc.health.v1 and reflection, bind, start; every service reports SERVING.

    Returns the bound port (``port`` 0 picks one) and the health servicer (for draining).
    """
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"cannot bind gRPC port {host}:{port}: in use or not available")
    server.start()
    for name in ("", *service_names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return bound, health_servicer


@dataclass(frozen=True)
class Running:
    """A started service (``start(args)`` of a server module): its port, a line that says where
    it listens, and how to stop everything it started."""

    port: int
    banner: str
    stop: Callable[[], object]


def serve_until_terminated(running: Running) -> int:
    """The main thread of ``epd serve ROLE``: announce, block until SIGINT/SIGTERM, stop."""
    print(running.banner, flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    running.stop()
    return 0
