"""The shared gRPC server: long calls are bounded, health and short calls always answer, the
plaintext health side port serves health alone, busy ports are start-up errors.

Real in-process gRPC servers and real channels; the service is a bytes-only echo."""

from __future__ import annotations

import socket
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.channels import create_channel
from common.grpc_server import create_server, start_server
from common.stream_capacity import StreamCapacity
from tests.common.echo import SERVICE, serve_echo, stream, unary

HEALTH_BOUND_S = 1.0


def health_latency(channel: grpc.Channel, service: str = "") -> float:
    start = time.monotonic()
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=HEALTH_BOUND_S
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return time.monotonic() - start


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def outcome(call) -> tuple[grpc.StatusCode, str]:
    try:
        list(call)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_streams_beyond_capacity_are_refused_at_once() -> None:
    server, port, echo = serve_echo(max_streams=2)
    try:
        with create_channel(f"127.0.0.1:{port}") as channel:
            admitted = [stream(channel) for _ in range(2)]
            assert [next(call) for call in admitted] == [b"started", b"started"]
            assert server.capacity.in_flight == 2
            with futures.ThreadPoolExecutor(4) as pool:
                excess = list(pool.map(lambda _: outcome(stream(channel)), range(4), timeout=30))
            message = "test server at its stream capacity 2: retry later or elsewhere"
            assert excess == [(grpc.StatusCode.RESOURCE_EXHAUSTED, message)] * 4
            assert server.capacity.in_flight == 2
            echo.release()
            assert [list(call) for call in admitted] == [[b"done"]] * 2
    finally:
        echo.release()
        server.stop(None)


def test_health_and_short_calls_answer_with_every_stream_slot_taken() -> None:
    server, port, echo = serve_echo(max_streams=3, reserve=2)
    try:
        with create_channel(f"127.0.0.1:{port}") as channel:
            admitted = [stream(channel) for _ in range(3)]
            assert {next(call) for call in admitted} == {b"started"}
            refused = []
            for _ in range(6):  # 3x the capacity in flight, then more
                try:
                    list(stream(channel))
                except grpc.RpcError as exc:
                    refused.append(exc.code())
                assert health_latency(channel) < HEALTH_BOUND_S
                assert health_latency(channel, SERVICE) < HEALTH_BOUND_S
                assert unary(channel, b"short") == b"short"
            assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 6
            echo.release()
            assert [list(call) for call in admitted] == [[b"done"]] * 3
            wait_until(lambda: server.capacity.in_flight == 0)
            assert list(stream(channel)) == [b"started", b"done"]  # slots were given back
    finally:
        echo.release()
        server.stop(None)


def test_a_cancelled_stream_gives_its_slot_back() -> None:
    server, port, echo = serve_echo(max_streams=1)
    try:
        with create_channel(f"127.0.0.1:{port}") as channel:
            call = stream(channel)
            assert next(call) == b"started"
            with pytest.raises(grpc.RpcError) as refused:
                list(stream(channel))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            call.cancel()
            wait_until(lambda: server.capacity.in_flight == 0)
            echo.release()
            assert list(stream(channel)) == [b"started", b"done"]
    finally:
        echo.release()
        server.stop(None)


def test_health_side_port_serves_health_alone_and_stops_with_the_server() -> None:
    health_port = free_tcp_port()
    server, port, echo = serve_echo(health_port=health_port)
    side = create_channel(f"127.0.0.1:{health_port}")
    try:
        assert health_latency(side) < HEALTH_BOUND_S
        assert health_latency(side, SERVICE) < HEALTH_BOUND_S
        with pytest.raises(grpc.RpcError) as exc:
            unary(side)
        assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with create_channel(f"127.0.0.1:{port}") as main:
            assert unary(main) == b"ping"
    finally:
        echo.release()
        server.stop(None).wait(10)
    with pytest.raises(grpc.RpcError) as gone:
        health_latency(side)
    assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
    side.close()


def free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("which", ["main", "health"])
def test_a_busy_port_is_an_oserror_naming_it(which: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        server = create_server("test", 4, StreamCapacity(0))
        main, health_port = (busy, 0) if which == "main" else (0, busy)
        with pytest.raises(OSError, match=f"127.0.0.1:{busy}"):
            start_server(server, "127.0.0.1", main, (SERVICE,), health_port=health_port)
        server.stop(None)


def test_capacity_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_streams >= 1"):
        StreamCapacity(0, ("/x.Y/Z",))
    with pytest.raises(ValueError, match="reserve >= 1"):
        StreamCapacity(4, reserve=0)
    assert StreamCapacity(4, reserve=3).num_threads == 7
    default = StreamCapacity(4, who="encoder").refusal
    assert default == "encoder at its stream capacity 4: retry later or elsewhere"
    assert StreamCapacity(4, message="queue is full").refusal == "queue is full"
