"""The language worker's gRPC API, with the server in its own process on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.models.hf_reference import HFReference
from common.transfer.config import TransferConfig
from protos.epd.v1 import common_pb2, language_pb2, language_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    model = tiny_model_dir("qwen2_5_vl")
    port = free_port()
    cmd = [sys.executable, "-m", "services.language.server", "--model-path", str(model)]
    env = dict(os.environ, EPD_LANGUAGE_PORT=str(port), EPD_LANGUAGE_NUM_KV_SLOTS="4096")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=60)
        yield model, channel
    finally:
        channel.close()
        proc.terminate()
        proc.wait(timeout=20)


def text_request(request_id: str, text: str, max_new_tokens: int = 8):
    part = common_pb2.ContentPart(text=text)
    return language_pb2.LanguageGenerateRequest(
        request_id=request_id,
        messages=[common_pb2.ChatMessage(role="user", content=[part])],
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens),
    )


def test_health_and_streaming_generate(server):
    model, channel = server
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="epd.v1.LanguageService"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    stub = language_pb2_grpc.LanguageServiceStub(channel)
    chunks = list(stub.Generate(text_request("g1", "hello over grpc", 8)))
    ref = HFReference(model)
    expected = ref.generate(ref.build_inputs("hello over grpc", []), 8)
    assert [t for c in chunks for t in c.token_ids] == expected
    final = chunks[-1]
    assert final.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
    assert final.usage.completion_tokens == len(expected)
    assert final.usage.prompt_tokens > 0 and final.timing.total_seconds > 0
    assert "".join(c.text for c in chunks) == ref.tokenizer.decode(
        expected, skip_special_tokens=True
    )
    # The same prompt again is served from the radix cache.
    again = list(stub.Generate(text_request("g2", "hello over grpc", 8)))
    assert again[-1].usage.cached_tokens >= 0.9 * final.usage.prompt_tokens
    load = stub.GetLoad(language_pb2.LanguageLoadRequest())
    assert load.num_kv_slots_total == 4096 and load.num_radix_hit_tokens > 0
    assert load.num_running == 0 and load.num_free_transfer_blocks == TransferConfig().num_blocks


def test_invalid_arguments(server):
    _, channel = server
    stub = language_pb2_grpc.LanguageServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(text_request("", "no id")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(text_request("big", "too long", max_new_tokens=10_000)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_client_cancel_aborts(server):
    _, channel = server
    stub = language_pb2_grpc.LanguageServiceStub(channel)
    request = text_request("c1", "a long answer please", max_new_tokens=2000)
    request.sampling.ignore_eos = True
    call = stub.Generate(request)
    next(call)  # the first token arrived: the request is decoding
    call.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        load = stub.GetLoad(language_pb2.LanguageLoadRequest())
        if load.num_running == 0:
            break
        time.sleep(0.05)
    assert load.num_running == 0
    assert load.num_kv_slots_used == load.num_radix_tokens  # only the cache holds slots
