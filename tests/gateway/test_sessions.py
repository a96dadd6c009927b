"""The gateway's sessions with a language worker (``services/gateway/sessions.py``): a real
worker process for the calls, a real in-process server for a worker without sessions, and the
lingering channel's hold."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest

from common.channels import create_channel
from protos.epd.v1 import common_pb2, language_pb2, language_pb2_grpc
from services.gateway.lingering import LingeringChannel
from services.gateway.registry import Role, Worker, create_stubs
from services.gateway.sessions import SessionSlot
from services.gateway.workers import generate
from tests.common.echo import STREAM, serve_echo
from tests.gateway.conftest import wait_until
from tests.language.test_grpc import REPO, free_port, server, text_request  # noqa: F401
from tests.language.test_sessions import wait_idle


def long_request(request_id: str) -> language_pb2.LanguageGenerateRequest:
    request = text_request(request_id, f"a long answer please {request_id}", 2000)
    request.sampling.ignore_eos = True
    return request


def test_calls_stream_end_and_cancel_as_generate_calls_do(server):  # noqa: F811
    _, channel, _ = server
    stub = language_pb2_grpc.LanguageServiceStub(channel)
    slot = SessionSlot(channel)
    calls = [slot.submit(text_request(f"c{i}", f"prompt {i}", 6), 30) for i in range(3)]
    for call in calls:
        chunks = list(call)  # ends after the request's last chunk
        assert sum(len(c.token_ids) for c in chunks) == 6
        assert chunks[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        assert not call.cancel()  # it ended: nothing to abort
    running = slot.submit(long_request("cancelled"), 30)
    assert next(running).token_ids
    assert running.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(running)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    late = slot.submit(long_request("deadline"), 1.0)
    with pytest.raises(grpc.RpcError) as err:
        list(late)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    bad = text_request("bad", "x")
    bad.sampling.top_p = 2.0
    with pytest.raises(grpc.RpcError) as err:
        next(slot.submit(bad, 30))  # the refusal comes with the first next, as Generate's
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()
    load = wait_idle(stub)  # the cancel and the deadline aborted both on the worker
    assert load.num_running == load.num_waiting == load.num_radix_locked_tokens == 0


def test_a_killed_worker_fails_every_call_then_a_new_session_opens(tmp_path, tiny_model_dir):
    model = tiny_model_dir("qwen2_5_vl")
    port = free_port()
    cmd = [sys.executable, "-m", "services.language.server", "--model-path", str(model)]
    env = dict(os.environ, EPD_LANGUAGE_PORT=str(port), EPD_LANGUAGE_NUM_KV_SLOTS="4096")

    def start():
        with open(tmp_path / "server.log", "ab") as log:
            return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    proc = start()
    channel = create_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=60)
        slot = SessionSlot(channel)
        calls = [slot.submit(long_request(f"k{i}"), 60) for i in range(3)]
        for call in calls:
            assert next(call).token_ids
        proc.kill()
        proc.wait(10)
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "session stream" in err.value.details()
        proc = start()  # the same address again: the next request opens a new session
        grpc.channel_ready_future(channel).result(timeout=60)
        chunks = list(slot.submit(text_request("again", "back again", 4), 60))
        assert sum(len(c.token_ids) for c in chunks) == 4
    finally:
        channel.close()
        proc.kill()
        proc.wait(10)


class GenerateOnly(language_pb2_grpc.LanguageServiceServicer):
    """A worker from before sessions: Generate, no Open."""

    def Generate(self, request, context):
        yield language_pb2.LanguageGenerateChunk(
            token_ids=[7], finish_reason=common_pb2.FINISH_REASON_LENGTH
        )


def test_a_worker_without_sessions_is_served_through_generate():
    old = grpc.server(futures.ThreadPoolExecutor(4))
    language_pb2_grpc.add_LanguageServiceServicer_to_server(GenerateOnly(), old)
    port = old.add_insecure_port("127.0.0.1:0")
    old.start()
    channel = create_channel(f"127.0.0.1:{port}")
    try:
        worker = Worker(f"127.0.0.1:{port}", Role.LANGUAGE, 8, True, channel)
        worker.stubs = create_stubs(channel, Role.LANGUAGE)
        for _ in range(2):
            chunks = list(generate(worker, "old", common_pb2.SamplingParams(), 10.0))
            assert [c.token_ids[0] for c in chunks] == [7]
        assert not worker.stubs.sessions.supported
    finally:
        channel.close()
        old.stop(None)


def test_a_hold_keeps_a_closing_channel_open_until_released():
    echo_server, port, echo = serve_echo(max_streams=4)
    channel = LingeringChannel(create_channel(f"127.0.0.1:{port}"))
    try:
        stream = channel.unheld.unary_stream(STREAM)(b"go", timeout=30)  # not counted
        assert next(stream) == b"started" and channel.num_calls == 0
        release = channel.hold()
        assert channel.num_calls == 1
        channel.close()
        assert not channel.closed
        with pytest.raises(ValueError, match="Channel closed"):
            channel.hold()  # refused once closing, as a new call is
        release()
        release()  # once only
        wait_until(lambda: channel.closed and channel.num_calls == 0)
        deadline = time.monotonic() + 10
        with pytest.raises(grpc.RpcError):  # the close ended the uncounted stream too
            while time.monotonic() < deadline:
                next(stream)
    finally:
        echo.release()
        channel.close()
        echo_server.stop(None)
