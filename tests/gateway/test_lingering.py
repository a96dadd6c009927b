"""A dropped worker's channel: calls in flight finish, new calls are refused at once the way a
closed channel refuses them, and the channel really closes after the last call.

A real in-process gRPC server (the bytes-only echo) and real channels."""

from __future__ import annotations

import grpc
import pytest

from common.channels import create_channel
from services.gateway.lingering import LingeringChannel
from tests.common.echo import STREAM, UNARY, serve_echo
from tests.gateway.conftest import wait_until


def test_close_waits_for_the_calls_in_flight() -> None:
    server, port, echo = serve_echo(max_streams=4)
    channel = LingeringChannel(create_channel(f"127.0.0.1:{port}"))
    try:
        unary, stream = channel.unary_unary(UNARY), channel.unary_stream(STREAM)
        assert unary(b"ping", timeout=5) == b"ping"
        assert unary.future(b"f", timeout=5).result() == b"f"
        assert channel.num_calls == 0
        running = stream(b"go", timeout=30)
        assert next(running) == b"started"
        assert channel.num_calls == 1
        channel.close()
        assert not channel.closed
        for start in (
            lambda: unary(b"late", timeout=5),
            lambda: unary.future(b"late", timeout=5),
            lambda: stream(b"late", timeout=5),
        ):
            with pytest.raises(ValueError, match="Channel closed"):
                start()  # refused synchronously, like a closed grpcio channel
        assert channel.num_calls == 1
        echo.release()
        assert list(running) == [b"done"]  # the stream was not cut by close()
        wait_until(lambda: channel.closed and channel.num_calls == 0)
    finally:
        echo.release()
        channel.close()
        server.stop(None)


def test_an_idle_channel_closes_at_once_and_a_cancelled_call_counts_out() -> None:
    server, port, echo = serve_echo(max_streams=4)
    try:
        idle = LingeringChannel(create_channel(f"127.0.0.1:{port}"))
        idle.close()
        assert idle.closed
        busy = LingeringChannel(create_channel(f"127.0.0.1:{port}"))
        call = busy.unary_stream(STREAM)(b"go", timeout=30)
        assert next(call) == b"started"
        busy.close()
        call.cancel()
        wait_until(lambda: busy.closed)
        with pytest.raises(grpc.RpcError):
            list(call)
    finally:
        echo.release()
        server.stop(None)


def test_abort_ends_the_calls_in_flight_at_once() -> None:
    """A worker that went silent: its channel is aborted, not left to linger."""
    server, port, echo = serve_echo(max_streams=4)
    channel = LingeringChannel(create_channel(f"127.0.0.1:{port}"))
    try:
        running = channel.unary_stream(STREAM)(b"go", timeout=30)
        assert next(running) == b"started"
        channel.abort()
        assert channel.closed
        with pytest.raises(grpc.RpcError) as ended:
            list(running)
        assert ended.value.code() == grpc.StatusCode.CANCELLED
        with pytest.raises(ValueError, match="Channel closed"):
            channel.unary_unary(UNARY)(b"late", timeout=5)
        wait_until(lambda: channel.num_calls == 0)
    finally:
        echo.release()
        server.stop(None)
