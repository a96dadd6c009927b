"""The drain support of the shared gRPC server: liveness and readiness told apart, the work
methods refused while the rest answers, the work in flight awaited on a condition, and the
public port's GOAWAY stop that lets streams finish.

Real in-process gRPC servers and real channels; the service is the bytes-only echo, whose
``Stream`` is the work method."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.channels import create_channel
from common.drain import READINESS
from common.grpc_server import Server, create_server, start_server
from common.stream_capacity import StreamCapacity
from tests.common.echo import SERVICE, STREAM, Echo, stream, unary

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def serve_gated(ready: bool = True, health_port: int = 0) -> tuple[Server, int, Echo]:
    echo = Echo()
    capacity = StreamCapacity(4, (STREAM,), who="test worker")
    server = create_server("test", 4, capacity, work_methods=(STREAM,))
    server.add_generic_rpc_handlers((echo.handler(),))
    port, _ = start_server(server, "127.0.0.1", 0, (SERVICE,), health_port, ready=ready)
    return server, port, echo


def status(channel: grpc.Channel, service: str) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=5
    )
    return reply.status


def test_liveness_stays_serving_while_readiness_follows_the_drain() -> None:
    server, port, echo = serve_gated(ready=False)
    try:
        with create_channel(f"127.0.0.1:{port}") as channel:
            assert status(channel, "") == SERVING
            assert status(channel, READINESS) == status(channel, SERVICE) == NOT_SERVING
            server.readiness.set(True)
            assert status(channel, READINESS) == status(channel, SERVICE) == SERVING
            server.readiness.drain()
            server.readiness.set(True)  # a late "ready" (a start-up timer) cannot undo a drain
            assert status(channel, READINESS) == status(channel, SERVICE) == NOT_SERVING
            assert status(channel, "") == SERVING
    finally:
        echo.release()
        server.stop(None)


def test_a_closed_gate_refuses_new_work_and_lets_the_rest_finish() -> None:
    server, port, echo = serve_gated()
    gate = server.gate
    try:
        with create_channel(f"127.0.0.1:{port}") as channel:
            running = [stream(channel) for _ in range(2)]
            assert [next(call) for call in running] == [b"started"] * 2
            assert gate.num_in_flight == 2
            gate.close()
            with pytest.raises(grpc.RpcError) as refused:
                list(stream(channel))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert refused.value.details() == "test worker is draining: retry on another"
            assert unary(channel, b"short") == b"short"  # not a work method: still served
            assert status(channel, "") == SERVING
            assert gate.num_in_flight == 2  # the refused call never counted
            assert not gate.wait_idle(time.monotonic() + 0.2)
            threading.Timer(0.3, echo.release).start()
            assert gate.wait_idle(time.monotonic() + 10)
            assert [list(call) for call in running] == [[b"done"]] * 2
    finally:
        echo.release()
        server.stop(None)


def test_wait_idle_wakes_when_the_last_call_ends_not_at_its_deadline() -> None:
    server, port, echo = serve_gated()
    try:
        with create_channel(f"127.0.0.1:{port}") as channel:
            call = stream(channel)
            assert next(call) == b"started"
            server.gate.close()
            threading.Timer(0.2, call.cancel).start()  # the client goes away
            start = time.monotonic()
            assert server.gate.wait_idle(start + 30)
            assert time.monotonic() - start < 5  # woken by the call's end, long before 30 s
    finally:
        echo.release()
        server.stop(None)


def refused_until_unavailable(channel: grpc.Channel, timeout_s: float = 10) -> set:
    """Send new calls until one is refused ``UNAVAILABLE`` (the client has the GOAWAY); none may
    succeed. Returns the other codes seen on the way: gRPC cancels a call that raced the GOAWAY
    (it reached the server after its shutdown began), so ``CANCELLED`` is the one allowed."""
    seen = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with pytest.raises(grpc.RpcError) as refused:
            unary(channel)
        if refused.value.code() == grpc.StatusCode.UNAVAILABLE:
            return seen
        seen.add(refused.value.code())
    raise AssertionError(f"no UNAVAILABLE within {timeout_s} s; saw {seen}")


def test_stop_accepting_finishes_streams_refuses_new_calls_and_keeps_probes() -> None:
    """The gateway's drain: GOAWAY on the main port, streams in flight go on, the health side
    port keeps answering the kubelet."""
    from tests.common.test_grpc_server import free_tcp_port

    health_port = free_tcp_port()
    server, port, echo = serve_gated(health_port=health_port)
    side = create_channel(f"127.0.0.1:{health_port}")
    try:
        with create_channel(f"127.0.0.1:{port}") as channel:
            call = stream(channel)
            assert next(call) == b"started"
            server.readiness.drain()
            done = server.stop_accepting(30)
            assert refused_until_unavailable(channel) <= {grpc.StatusCode.CANCELLED}
            assert status(side, "") == SERVING
            assert status(side, READINESS) == NOT_SERVING
            assert not done.is_set()
            echo.release()
            assert list(call) == [b"done"]
            assert done.wait(10)
            assert status(side, "") == SERVING  # until the process stops everything
    finally:
        echo.release()
        server.stop(None).wait(10)
        side.close()
