"""A small real gRPC service for tests of the server plumbing (raw bytes, no protos).

``/test.Echo/Unary`` answers its request. ``/test.Echo/Stream`` sends ``b"started"``, then
holds its thread until ``release()`` (or until the call ends), then sends ``b"done"``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc

from common.grpc_server import Server, ServerSecurity, create_server, start_server
from common.stream_capacity import StreamCapacity

SERVICE = "test.Echo"
UNARY = f"/{SERVICE}/Unary"
STREAM = f"/{SERVICE}/Stream"
HOLD_S = 60.0


class Echo:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._released = False
        self._holding: list[threading.Event] = []

    def unary(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return request

    def stream(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        done = threading.Event()
        context.add_callback(done.set)  # the call ended (cancelled): stop holding
        with self._lock:
            if self._released:
                done.set()
            self._holding.append(done)
        yield b"started"
        done.wait(HOLD_S)
        yield b"done"

    def release(self) -> None:
        with self._lock:
            self._released = True
            for event in self._holding:
                event.set()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Unary": grpc.unary_unary_rpc_method_handler(self.unary),
                "Stream": grpc.unary_stream_rpc_method_handler(self.stream),
            },
        )


def serve_echo(
    max_streams: int = 2,
    security: ServerSecurity | None = None,
    health_port: int = 0,
    reserve: int = 4,
) -> tuple[Server, int, Echo]:
    echo = Echo()
    capacity = StreamCapacity(max_streams, (STREAM,), reserve=reserve, who="test server")
    server = create_server("test", 4, capacity, security)
    server.add_generic_rpc_handlers((echo.handler(),))
    port, _ = start_server(server, "127.0.0.1", 0, (SERVICE,), health_port=health_port)
    return server, port, echo


def unary(channel: grpc.Channel, payload: bytes = b"ping", **kw) -> bytes:
    return channel.unary_unary(UNARY)(payload, timeout=10, **kw)


def stream(channel: grpc.Channel, payload: bytes = b"go", **kw):
    return channel.unary_stream(STREAM)(payload, timeout=60, **kw)
