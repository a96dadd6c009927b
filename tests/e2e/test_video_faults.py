"""Faults mid-video through a real stack: a long clip is decoded, encoded frame group by frame
group and shipped in continuations; the client cancelling, the encoder being SIGKILLed, or the
request's deadline passing while that happens ends the request alone with a clear status, and
nothing stays held (blocks, rooms, patch bytes, radix locks). A cancel or a deadline that comes
while the encoder still decodes the video stops the decode there."""

from __future__ import annotations

import base64
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from functools import partial

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


DEADLINE_S = 2.0


@pytest.fixture(scope="module")
def slow_clip() -> bytes:
    """300 s of 320x240 (600 frames sampled at 2 fps): its decode lasts far longer than the
    few milliseconds the test needs to see it start."""
    return make_video(num_frames=1200, width=320, height=240, fps=4, seed=23)


def streaming(request_: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateRequest:
    request_.sampling.max_new_tokens = 64
    return request_


def test_client_cancel_and_encoder_killed_mid_video(
    tiny_model_dir, stack_factory, long_clip, slow_clip
):
    env, _ = video_env(ARCH)
    env |= {
        "EPD_ENCODER_MAX_BATCH_PATCHES": "64",  # one frame group per ViT forward
        "EPD_TRANSFER_DEFAULT_TOKENS": "256",
        "EPD_LANGUAGE_CHUNK_SIZE": "96",
    }
    stack = stack_factory(tiny_model_dir(ARCH), num_encoders=2, env=env)
    with stack.client() as client:
        # the client cancels while an encoder still decodes a long clip: the gateway's
        # Encoder.Cancel stops the decode at the next frame (no frame counted, the log says so)
        num_frames = video_frames(stack)
        call = client.stream_request(streaming(request(slow_clip)), timeout=120)
        with ThreadPoolExecutor(1) as pool:
            outcome = Outcome()
            done = pool.submit(consume, call, outcome)
            encoder = wait_for(lambda: decoding_encoder(stack), 30, "an encoder to decode")
            call.cancel()
            done.result(timeout=60)
        assert outcome.code == grpc.StatusCode.CANCELLED, (outcome.code, outcome.details)
        stack.wait_no_leaks()
        assert video_frames(stack) == num_frames
        log = encoder.log_path.read_text()
        assert "dropped: cancelled: request cancelled while decoding the video" in log, log[-3000:]

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
            # another clip: the first one's frame groups may all be cached by now, and a clip
            # served from the cache is shipped before the encoder could be killed mid-way
            other = make_video(num_frames=240, width=96, height=72, fps=4, seed=22)
            call = client.stream_request(streaming(request(other, text="Again?")), 120)
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


def decoding(stack, i: int = 0) -> bool:
    """Encoder ``i`` holds the video's patch bytes and no room yet: it is inside ``accept``,
    decoding the video."""
    load = stack.encoder_load(i)
    return load.queued_pixel_bytes > 0 and load.num_queued_requests == 0


def decoding_encoder(stack):
    """The encoder decoding a video now, or None."""
    return next((e for i, e in enumerate(stack.encoders) if decoding(stack, i)), None)


def video_frames(stack) -> list[int]:
    """Video frames each encoder decoded so far."""
    return [stack.encoder_load(i).num_video_frames for i in range(len(stack.encoders))]


def grpc_outcome(client, clip: bytes) -> str:
    with pytest.raises(grpc.RpcError) as info:
        client.unary_request(request(clip), timeout=DEADLINE_S)
    return info.value.code().name


def http_outcome(http_url: str, clip: bytes) -> str:
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    video = {"type": "video_url", "video_url": {"url": url}}
    content = [video, {"type": "text", "text": "What happens?"}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}
    headers = {"X-Request-Timeout": str(DEADLINE_S)}
    reply = httpx.post(f"{http_url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    return f"{reply.status_code} {reply.json()['error']['code']}"


def test_deadline_passing_while_the_video_decodes(tiny_model_dir, stack_factory, slow_clip):
    """The request's deadline passes while the encoder decodes the video, over gRPC
    (DEADLINE_EXCEEDED) and HTTP (``X-Request-Timeout``: 504). To make that certain on any
    machine, the encoder is paused (SIGSTOP) once it is decoding and resumed after the client
    got its answer: it then stops decoding at its next frame and drops the room (its frames
    never counted, its log says why), nothing stays held, and the next requests are served."""
    env, _ = video_env(ARCH)
    stack = stack_factory(tiny_model_dir(ARCH), env=env, http_port=0)
    encoder = stack.encoders[0]
    with stack.client() as client, ThreadPoolExecutor(1) as pool:
        sends = {
            "DEADLINE_EXCEEDED": partial(grpc_outcome, client, slow_clip),
            "504 deadline_exceeded": partial(http_outcome, stack.http_url, slow_clip),
        }
        for expected, send in sends.items():
            num_frames = stack.encoder_load().num_video_frames
            done = pool.submit(send)
            wait_for(lambda: decoding(stack), 30, "the encoder to decode the video")
            encoder.kill(signal.SIGSTOP)
            try:
                assert done.result(timeout=60) == expected
            finally:
                encoder.kill(signal.SIGCONT)
            stack.wait_no_leaks()  # the patch bytes stay reserved until the decode stops
            assert stack.encoder_load().num_video_frames == num_frames
            stack.wait_registered(30)
        log = encoder.log_path.read_text()
        # the deadline check between frames, or the gateway's Cancel once the request's
        # deadline ended it there (named after the call that expired, or after the request):
        # whichever the decode saw first stopped it
        stopped = re.findall(
            r"dropped: (the deadline passed|cancelled: [^\n]*) while decoding the video", log
        )
        assert len(stopped) == 2, log[-3000:]
        reply = client.unary_request(request(make_video(num_frames=8)), timeout=120)
        assert reply.token_ids
        assert client.generate("Hello there", [], max_tokens=4, timeout=60).token_ids
    stack.wait_no_leaks()
