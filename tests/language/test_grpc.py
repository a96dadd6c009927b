"""The language worker's gRPC API, with the server in its own process on 127.0.0.1."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.models.hf_reference import HFReference
from common.transfer.config import TransferConfig
from protos.epd.v1 import common_pb2, language_pb2, language_pb2_grpc
from services.language.model.config import TextModelConfig

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("qwen2_5_vl")
    port = free_port()
    cmd = [sys.executable, "-m", "services.language.server", "--model-path", str(model)]
    env = dict(os.environ, EPD_LANGUAGE_PORT=str(port), EPD_LANGUAGE_NUM_KV_SLOTS="4096")
    log_path = tmp_path_factory.mktemp("language") / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=60)
        yield model, channel, log_path
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
    model, channel, _ = server
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
    _, channel, _ = server
    stub = language_pb2_grpc.LanguageServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(text_request("", "no id")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(text_request("big", "too long", max_new_tokens=10_000)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_client_cancel_aborts(server):
    _, channel, _ = server
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


def generate_error(stub, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=30))
    return err.value


def test_bad_sampling_is_invalid_argument_naming_the_field(server):
    model, channel, _ = server
    vocab = TextModelConfig.from_pretrained(model).vocab_size
    stub = language_pb2_grpc.LanguageServiceStub(channel)
    cases = [
        ("temperature", float("nan"), "temperature must be a finite number in [0, 100]"),
        ("temperature", 1e9, "temperature must be a finite number in [0, 100]"),
        ("top_p", 1.5, "top_p must be a finite number in (0, 1]"),
        ("top_k", -7, "top_k must be >= 0"),
        ("frequency_penalty", 3.0, "frequency_penalty must be a finite number in [-2, 2]"),
        ("presence_penalty", float("nan"), "presence_penalty must be a finite number in [-2, 2]"),
        ("repetition_penalty", -1.0, "repetition_penalty must be a finite number in (0, 10]"),
        ("min_p", 1.5, "min_p must be a finite number in [0, 1]"),
        ("min_tokens", 9, "min_tokens must be at most max_new_tokens (8)"),
    ]
    for i, (name, value, message) in enumerate(cases):
        request = text_request(f"bad{i}", "hello")
        setattr(request.sampling, name, value)
        err = generate_error(stub, request)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.details()
    request = text_request("bad-stop", "hello")
    request.sampling.stop_token_ids.append(-3)
    err = generate_error(stub, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids" in err.details()
    for token_id, words in ((-1, ">= 0, got -1"), (1 << 20, f"in [0, {vocab})")):
        request = text_request(f"bad-bias{token_id}", "hello")
        request.sampling.logit_bias[token_id] = 1.0
        err = generate_error(stub, request)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert f"logit_bias token ids must be {words}" in err.details()
    # a temperature below 1e-2 is served (clamped), and so is top_k -1 ("off")
    request = text_request("tiny-t", "hello", 4)
    request.sampling.temperature, request.sampling.top_k = 1e-30, -1
    chunks = list(stub.Generate(request, timeout=30))
    assert chunks[-1].finish_reason in (
        common_pb2.FINISH_REASON_LENGTH,
        common_pb2.FINISH_REASON_STOP,
    )
    # the controls are served; repetition_penalty 0 is the proto's unset (off)
    request = text_request("controls", "hello", 5)
    s = request.sampling
    s.frequency_penalty, s.presence_penalty, s.min_p, s.min_tokens = 0.5, 0.5, 0.1, 5
    s.logit_bias[vocab - 1] = 100.0
    chunks = list(stub.Generate(request, timeout=30))
    assert [t for c in chunks for t in c.token_ids] == [vocab - 1] * 5


def test_over_max_seq_len_names_both_numbers(server):
    _, channel, _ = server
    stub = language_pb2_grpc.LanguageServiceStub(channel)
    err = generate_error(stub, text_request("long", "too long", max_new_tokens=4090))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.fullmatch(
        r"prompt is (\d+) tokens and max_new_tokens is 4090: (\d+) exceeds this worker's "
        r"max_seq_len 4096",
        err.details(),
    ), err.details()
    load = stub.GetLoad(language_pb2.LanguageLoadRequest())
    assert load.num_waiting == load.num_running == 0


def test_load_advertises_layout_and_max_seq_len(server):
    _, channel, log_path = server
    stub = language_pb2_grpc.LanguageServiceStub(channel)
    load = stub.GetLoad(language_pb2.LanguageLoadRequest())
    assert load.max_seq_len == 4096  # the pool (4096 slots) is below the model's 32768
    layout = load.transfer_layout
    assert (layout.hidden_size, layout.num_deepstack) == (128, 0)
    assert (layout.dtype, layout.block_size) == ("bfloat16", 128)
    log = log_path.read_text()
    assert "device cpu, compute dtype float32, wire dtype bfloat16, KV pool 4096 tokens" in log, log
    assert "max_seq_len 4096" in log


def test_duplicate_request_id_in_flight_is_refused(server):
    _, channel, _ = server
    stub = language_pb2_grpc.LanguageServiceStub(channel)
    request = text_request("dup", "a long answer please", max_new_tokens=2000)
    request.sampling.ignore_eos = True
    first = stub.Generate(request)
    next(first)
    err = generate_error(stub, request)
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS and "dup" in err.details()
    first.cancel()


def test_raw_prompt_text_and_ids_without_chat_template(server):
    """A raw prompt is tokenized as it is (no chat template): its greedy answer is the
    reference's on the same ids; its token ids give the same answer; echo returns the text."""
    model, channel, _ = server
    stub = language_pb2_grpc.LanguageServiceStub(channel)
    text = "raw prompt over grpc"
    sampling = common_pb2.SamplingParams(max_new_tokens=6, ignore_eos=True, prompt_logprobs=0)
    chunks = list(
        stub.Generate(
            language_pb2.LanguageGenerateRequest(
                request_id="raw1", prompt_text=text, sampling=sampling, echo=True
            )
        )
    )
    ref = HFReference(model)
    ids = ref.tokenizer(text).input_ids
    assert [p.token_id for p in chunks[0].prompt_logprobs] == ids
    assert chunks[0].prompt_text == text and all(not c.prompt_text for c in chunks[1:])
    assert chunks[-1].usage.prompt_tokens == len(ids)
    inputs = ref.build_inputs(text, [])
    inputs.input_ids = torch.tensor([ids])
    inputs.mm_token_type_ids = torch.zeros_like(inputs.input_ids)
    expected = ref.generate(inputs, 6)
    assert [t for c in chunks for t in c.token_ids] == expected
    by_ids = list(
        stub.Generate(
            language_pb2.LanguageGenerateRequest(
                request_id="raw2", prompt_token_ids=ids, sampling=sampling, echo=True
            )
        )
    )
    assert [t for c in by_ids for t in c.token_ids] == expected
    assert by_ids[0].prompt_text == ref.tokenizer.decode(ids)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"prompt_text": "a", "prompt_token_ids": [1]}, "at most one of"),
        ({"prompt_token_ids": [1, 10**6]}, "prompt_token_ids[1] must be in [0, "),
        ({"prompt_text": "a", "echo": False, "room": 5, "encoder_endpoint": "e"}, "at most one"),
        ({"messages": [common_pb2.ChatMessage(role="user")], "echo": True}, "echo needs"),
        ({}, "without a prompt"),
    ],
)
def test_raw_prompt_refusals_name_the_field(server, fields, words):
    _, channel, _ = server
    stub = language_pb2_grpc.LanguageServiceStub(channel)
    request = language_pb2.LanguageGenerateRequest(request_id="bad-raw", **fields)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()
