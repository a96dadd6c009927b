"""Scale-down without failed requests: a worker that gets SIGTERM under load drains.

Real processes on 127.0.0.1 (gateway, encoders, language workers), real Mooncake, ZMQ and gRPC.
The worker leaves the gateway at once (new requests go to the other worker), refuses new work
with UNAVAILABLE "draining", serves what it holds to the end — streams, rooms it is encoding,
sending or receiving — and exits by itself (status 0) well within its drain timeout.
"""

from __future__ import annotations

import itertools
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.procs import ServiceProcess
from protos.epd.v1 import (
    common_pb2,
    encoder_pb2,
    encoder_pb2_grpc,
    gateway_pb2,
    language_pb2,
    language_pb2_grpc,
)
from tests.e2e.conftest import Stack, noise_image, png_bytes
from tests.e2e.test_elastic_gateways import Timed, timed_stream
from tests.e2e.test_faults import wait_for

ARCH = "qwen2_5_vl"
DRAIN_TIMEOUT_S = 90
NUM_REQUESTS = 24
LONG = {"max_tokens": 300, "ignore_eos": True}  # >= 200 tokens each, finish_reason length
ANCHOR = {"max_tokens": 2000, "ignore_eos": True}  # seconds of decode
WORKER_ARGS = ("--drain-timeout-s", str(DRAIN_TIMEOUT_S))


def registered(stack: Stack, role: str) -> set[str]:
    return {w.address for w in stack.workers() if w.role == role}


def assert_exits_by_itself(proc: ServiceProcess, since: float) -> float:
    """The drained worker exits on its own with status 0, before its drain timeout; returns
    how long after ``since`` it exited."""
    assert proc.proc.wait(DRAIN_TIMEOUT_S + 10) == 0, proc.tail()
    took = time.monotonic() - since
    assert took < DRAIN_TIMEOUT_S, f"{proc.name} took {took:.0f} s: the drain timed out"
    log = proc.log_path.read_text()
    assert "drained in" in log and "drain timeout" not in log, proc.tail()
    return took


def refused_while_draining(call) -> str:
    """The details of the UNAVAILABLE a draining worker answers ``call()`` with ('' when it
    still took the call)."""
    try:
        call()
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            return exc.details() or ""
        raise
    return ""


def start_streams(pool, client, requests, **sampling) -> list[Timed]:
    """``requests`` (prompt, images) streamed in the background, timed."""
    outs = []
    for prompt, images in requests:
        out = Timed()
        out.future = pool.submit(timed_stream, client, prompt, images, out, **sampling)
        outs.append(out)
    return outs


def finished(out: Timed, max_tokens: int) -> gateway_pb2.GenerateChunk:
    """The final chunk of a request that completed with all its tokens."""
    out.future.result(180)
    assert out.code == grpc.StatusCode.OK, (out.code, out.details)
    assert out.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert sum(len(c.token_ids) for c in out.chunks) == max_tokens
    return out.chunks[-1]


def test_sigterm_a_language_worker_under_load(tiny_model_dir, stack_factory) -> None:
    """The victim is the worker serving a long anchor request (2000 tokens), so its drain
    outlasts the checks made during it, whatever the machine's speed."""
    stack = stack_factory(tiny_model_dir(ARCH), num_languages=2, worker_args=WORKER_ARGS)
    small = png_bytes(noise_image(7, 112))
    with stack.client() as client, ThreadPoolExecutor(NUM_REQUESTS + 8) as pool:
        (anchor,) = start_streams(pool, client, [("A long story.", [])], **ANCHOR)
        wait_for(lambda: anchor.chunk_times, 60, "the anchor streaming")
        index = next(i for i in range(2) if stack.language_load(i).num_running)
        victim, survivor = stack.languages[index], stack.languages[1 - index]
        requests = [(f"Story {i}.", [small] if i % 3 == 0 else []) for i in range(NUM_REQUESTS)]
        running = start_streams(pool, client, requests, **LONG)
        wait_for(lambda: stack.language_load(index).num_running >= 5, 60, "the victim busy")
        wait_for(lambda: sum(bool(o.chunk_times) for o in running) >= 8, 60, "streams")
        sigterm_at = time.monotonic()
        victim.kill(signal.SIGTERM)

        wait_for(lambda: victim.address not in registered(stack, "language"), 5, "deregistered")
        with stack.channel(victim.address) as channel:
            stub = language_pb2_grpc.LanguageServiceStub(channel)
            message = common_pb2.ChatMessage(
                role="user", content=[common_pb2.ContentPart(text="Hi")]
            )
            direct = language_pb2.LanguageGenerateRequest(request_id="direct", messages=[message])
            details = wait_for(
                lambda: refused_while_draining(lambda: list(stub.Generate(direct, timeout=10))),
                5,
                "the victim refusing new work",
            )
            assert details == "language worker is draining: retry on another"
            assert stub.GetLoad(language_pb2.LanguageLoadRequest(), timeout=5).num_running > 0
        # new requests during the drain: all to the other worker
        new = [
            pool.submit(client.generate, f"New {i}", [small] if i % 2 else [], max_tokens=8)
            for i in range(8)
        ]
        assert {f.result(timeout=120).language for f in new} == {survivor.address}
        assert victim.alive()  # they all came and went while it drained

        served_by = [finished(out, LONG["max_tokens"]).language for out in running]
        assert finished(anchor, ANCHOR["max_tokens"]).language == victim.address
    assert served_by.count(victim.address) >= 4, served_by  # the drain was not idle
    assert_exits_by_itself(victim, sigterm_at)
    stack.wait_no_leaks()


def encode_request(
    room: int, image: bytes | None = None, timeout_s: float = 0.0
) -> encoder_pb2.EncodeRequest:
    parts = [common_pb2.ContentPart(text="Hi")]
    if image is not None:
        parts.insert(0, common_pb2.ContentPart(image=common_pb2.ImageSource(data=image)))
    message = common_pb2.ChatMessage(role="user", content=parts)
    return encoder_pb2.EncodeRequest(
        room=room, request_id=f"direct-{room}", messages=[message], timeout_s=timeout_s
    )


def test_sigterm_an_encoder_with_rooms_queued_and_in_transfer(
    tiny_model_dir, stack_factory
) -> None:
    """Image requests of 448x448 noise (every one distinct: no cache hits) keep rooms queued for
    the victim's ViT and in transfer when SIGTERM comes. A room encoded for nobody (sent to the
    victim directly: no language worker ever asks for it) keeps its drain going until that
    request's deadline ends the room, so the checks made during the drain do not
    race its end. The encoders take as many Encode calls at once as there are requests (the
    survivor alone gets them all once the victim left)."""
    worker_args = (*WORKER_ARGS, "--grpc-workers", str(NUM_REQUESTS + 8))
    stack = stack_factory(tiny_model_dir(ARCH), num_encoders=2, worker_args=worker_args)
    victim, survivor = stack.encoders
    images = [png_bytes(noise_image(300 + i, 448)) for i in range(NUM_REQUESTS)]
    with stack.client() as client, ThreadPoolExecutor(NUM_REQUESTS + 8) as pool:
        requests = [(f"Picture {i}?", [images[i]]) for i in range(NUM_REQUESTS)]
        running = start_streams(pool, client, requests, max_tokens=16, ignore_eos=True)
        wait_for(lambda: stack.encoder_load(0).num_queued_requests, 60, "rooms queued on it")
        with stack.channel(victim.address) as channel:
            stub = encoder_pb2_grpc.EncoderStub(channel)
            # its request's deadline (15 s) ends it: a room is waited for while its request lives
            lonely = encode_request(4242, png_bytes(noise_image(4242, 56)), timeout_s=15.0)
            stub.Encode(lonely, timeout=10)
            sigterm_at = time.monotonic()
            victim.kill(signal.SIGTERM)

            wait_for(lambda: victim.address not in registered(stack, "encoder"), 5, "deregistered")
            rooms = itertools.count(1)  # a probe taken before the gate closed holds its room
            details = wait_for(
                lambda: refused_while_draining(
                    lambda: stub.Encode(encode_request(next(rooms), timeout_s=15.0), timeout=10)
                ),
                5,
                "the victim refusing new work",
            )
            assert details == "encoder is draining: retry on another"
            assert stub.GetLoad(encoder_pb2.GetLoadRequest(), timeout=5).sender_endpoint
        fresh = [png_bytes(noise_image(900 + i, 112)) for i in range(6)]
        new = [pool.submit(client.generate, "New?", [image], max_tokens=4) for image in fresh]
        assert victim.alive()  # sent while it drained
        assert {f.result(timeout=120).encoder for f in new} == {survivor.address}

        served_by = [(finished(out, 16).encoder, out.chunk_times[0]) for out in running]
    after = [at for encoder, at in served_by if encoder == victim.address and at > sigterm_at]
    assert after, "no room the victim held at SIGTERM was delivered during its drain"
    assert_exits_by_itself(victim, sigterm_at)
    stack.wait_no_leaks()


@pytest.mark.parametrize("role", ["encoder", "language"])
def test_an_idle_worker_drains_at_once(role: str, tiny_model_dir, stack_factory) -> None:
    """Nothing in flight: SIGTERM to exit takes about the deregistration's settle time, and the
    gateway forgets the worker at once (not after its expiry)."""
    stack = stack_factory(tiny_model_dir(ARCH), worker_args=WORKER_ARGS)
    proc = stack.encoders[0] if role == "encoder" else stack.languages[0]
    sigterm_at = time.monotonic()
    proc.kill(signal.SIGTERM)
    wait_for(lambda: proc.address not in registered(stack, role), 30, "deregistered")
    # told by the worker, not dropped by expiry (which does not log this line)
    assert f"{role} worker {proc.address} deregistered" in stack.gateway.log_path.read_text()
    assert assert_exits_by_itself(proc, sigterm_at) < 10


def test_sigterm_while_starting_drains_once_started(tiny_model_dir, stack_factory) -> None:
    """A pod may be told to stop while it loads: the worker does not die mid-start (registered
    and then silent until its expiry); it finishes starting, drains and exits 0."""
    stack = stack_factory(tiny_model_dir(ARCH), worker_args=WORKER_ARGS)
    proc = stack.start_worker("encoder", wait=False)
    wait_for(lambda: "vision tower on" in proc.log_path.read_text(), 120, "the model loading")
    sigterm_at = time.monotonic()
    proc.kill(signal.SIGTERM)
    assert_exits_by_itself(proc, sigterm_at)
    assert proc.address not in registered(stack, "encoder")
    assert "went silent" not in stack.gateway.log_path.read_text()
