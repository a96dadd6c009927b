"""Faults mid-video through a real stack: a long clip is decoded, encoded frame group by frame
group and shipped in continuations; the client cancelling, or the encoder being SIGKILLed,
while that happens ends the request alone with a clear status, and nothing stays held (blocks,
rooms, patch bytes, radix locks)."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos.epd.v1 import gateway_pb2
from tests.e2e.test_faults import Outcome, by_address, consume, encoder_in_flight, wait_for
from tests.e2e.test_video import request, video_env
from tests.media import make_video

ARCH = "qwen2_5_vl"


@pytest.fixture(scope="module")
def long_clip() -> bytes:
    return make_video(num_frames=240, width=96, height=72, fps=4, seed=21)  # 60 s


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
