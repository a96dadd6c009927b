"""Faults mid-video through a real stack: a long clip is decoded, encoded frame group by frame
group and shipped in continuations; the client cancelling, the encoder being SIGKILLed, or the
request's deadline passing while that happens ends the request alone with a clear status, and
nothing stays held (blocks, rooms, patch bytes, radix locks)."""

from __future__ import annotations

import base64
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from protos.epd.v1 import gateway_pb2
from tests.e2e.test_faults import Outcome, by_address, consume, encoder_in_flight, wait_for
from tests.e2e.test_video import request, video_env
from tests.media import make_video

ARCH = "qwen2_5_vl"


@pytest.fixture(scope="module")
def long_clip() -> bytes:
    return make_video(num_frames=240, width=96, height=72, fps=4, seed=21)  # 60 s


@pytest.fixture(scope="module")
def slow_clip() -> bytes:
    """300 s of 640x480 (600 frames sampled at 2 fps): its decode takes seconds (~5 s here),
    many times the deadlines below."""
    return make_video(num_frames=1200, width=640, height=480, fps=4, seed=23)


def streaming(request_: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateRequest:
    request_.sampling.max_new_tokens = 64
    return request_


def test_client_cancel_and_encoder_killed_mid_video(tiny_model_dir, stack_factory, long_clip):
    env, _ = video_env(ARCH)
    env |= {
        "EPD_ENCODER_MAX_BATCH_PATCHES": "64",  # one frame group per ViT forward
        "EPD_TRANSFER_DEFAULT_TOKENS": "256",
        "EPD_LANGUAGE_CHUNK_SIZE": "96",
    }
    stack = stack_factory(tiny_model_dir(ARCH), num_encoders=2, env=env)
    with stack.client() as client:
        # the client cancels while an encoder works on the clip
        call = client.stream_request(streaming(request(long_clip)), timeout=120)
        with ThreadPoolExecutor(1) as pool:
            outcome = Outcome()
            done = pool.submit(consume, call, outcome)
            wait_for(lambda: encoder_in_flight(stack), 30, "an encoder to take the video")
            call.cancel()
            done.result(timeout=60)
        assert outcome.code == grpc.StatusCode.CANCELLED, (outcome.code, outcome.details)
        stack.wait_no_leaks()

        # an encoder is killed while the language worker already prefills the first groups
        with ThreadPoolExecutor(1) as pool:
            outcome = Outcome()
            call = client.stream_request(streaming(request(long_clip, text="Again?")), 120)
            done = pool.submit(consume, call, outcome)
            address = wait_for(lambda: encoder_in_flight(stack), 30, "an encoder to accept")
            victim = by_address(stack.encoders, address)

            def prefilling_while_receiving() -> bool:
                load = stack.language_load()
                return load.num_receiving == 1 and load.num_kv_slots_used > load.num_radix_tokens

            wait_for(prefilling_while_receiving, 60, "prefill while the video still arrives")
            victim.kill(signal.SIGKILL)
            done.result(timeout=60)
        assert outcome.code == grpc.StatusCode.UNAVAILABLE, (outcome.code, outcome.details)
        assert outcome.num_tokens == 0
        victim.proc.wait(10)
        reply = client.generate("Hello there", [], max_tokens=4, timeout=60)
        assert reply.token_ids
    stack.wait_no_leaks()


def test_deadline_passing_while_the_video_decodes(tiny_model_dir, stack_factory, slow_clip):
    """A 1 s deadline against seconds of decoding, over gRPC (DEADLINE_EXCEEDED) and HTTP
    (``X-Request-Timeout``: 504): the request ends at its deadline while the encoder still
    decodes; the encoder stops decoding there and drops the room (it says so in its log),
    nothing stays held, and the next request is served."""
    env, _ = video_env(ARCH)
    stack = stack_factory(tiny_model_dir(ARCH), env=env, http_port=0)
    url = "data:video/mp4;base64," + base64.b64encode(slow_clip).decode()
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": url}},
                    {"type": "text", "text": "What happens?"},
                ],
            }
        ],
        "max_tokens": 4,
    }
    with stack.client() as client:
        for api in ("grpc", "http"):
            decoded = stack.encoder_load().num_video_frames
            if api == "grpc":
                with pytest.raises(grpc.RpcError) as info:
                    client.unary_request(request(slow_clip), timeout=1.0)
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
            else:
                headers = {"X-Request-Timeout": "1"}
                reply = httpx.post(
                    stack.http_url + "/v1/chat/completions", json=body, headers=headers, timeout=60
                )
                assert reply.status_code == 504, reply.text
                assert reply.json()["error"]["code"] == "deadline_exceeded"
            stack.wait_no_leaks()  # the video's patch bytes stay reserved while it decodes
            # the encoder stopped decoding at the deadline: the video's frames never counted
            assert stack.encoder_load().num_video_frames == decoded
        log = stack.encoders[0].log_path.read_text()
        assert log.count("the deadline passed while decoding the video") == 2, log[-3000:]
        reply = client.unary_request(request(make_video(num_frames=8)), timeout=120)
        assert reply.token_ids
        assert client.generate("Hello there", [], max_tokens=4, timeout=60).token_ids
    stack.wait_no_leaks()
