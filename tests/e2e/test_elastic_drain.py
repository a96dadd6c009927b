"""Scale-down without failed requests: a worker that gets SIGTERM under load drains.

Real processes on 127.0.0.1 (gateway, encoders, language workers), real Mooncake, ZMQ and gRPC.
The worker leaves the gateway at once (new requests go to the other worker), refuses new work
with UNAVAILABLE "draining", serves what it holds to the end — streams, rooms it is encoding,
sending or receiving — and exits by itself (status 0) well within its drain timeout.
"""

from __future__ import annotations

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
    language_pb2,
    language_pb2_grpc,
)
from tests.e2e.conftest import Stack, noise_image, png_bytes
from tests.e2e.test_faults import Outcome, stream_in_background, wait_for

ARCH = "qwen2_5_vl"
DRAIN_TIMEOUT_S = 90
NUM_REQUESTS = 24
LONG = {"max_tokens": 300, "ignore_eos": True}  # >= 200 tokens each, finish_reason length
WORKER_ARGS = ("--drain-timeout-s", str(DRAIN_TIMEOUT_S))


def registered(stack: Stack, role: str) -> set[str]:
    return {w.address for w in stack.workers() if w.role == role}


def final(outcome: Outcome):
    assert outcome.code == grpc.StatusCode.OK, (outcome.code, outcome.details)
    last = outcome.chunks[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH, last
    return last


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


def test_sigterm_a_language_worker_under_load(tiny_model_dir, stack_factory) -> None:
    stack = stack_factory(tiny_model_dir(ARCH), num_languages=2, worker_args=WORKER_ARGS)
    victim, survivor = stack.languages
    small = png_bytes(noise_image(7, 112))
    with stack.client() as client, ThreadPoolExecutor(NUM_REQUESTS + 8) as pool:
        running = [
            stream_in_background(
                pool, client, f"Story {i}.", [small] if i % 3 == 0 else [], timeout=120, **LONG
            )
            for i in range(NUM_REQUESTS)
        ]
        wait_for(lambda: stack.language_load(0).num_running >= 4, 60, "the victim decoding")
        wait_for(lambda: sum(o.first_chunk.is_set() for o, _ in running) >= 8, 60, "streams")
        sigterm_at = time.monotonic()
        victim.kill(signal.SIGTERM)

        wait_for(lambda: victim.address not in registered(stack, "language"), 5, "deregistered")
        assert stack.language_load(0).num_running > 0  # still serving what it holds
        # new requests during the drain: all to the other worker
        new = [
            pool.submit(client.generate, f"New {i}", [small] if i % 2 else [], max_tokens=8)
            for i in range(8)
        ]
        assert {f.result(timeout=120).language for f in new} == {survivor.address}
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

        served_by = [final(outcome).language for outcome, done in running if done.result(150)]
    assert served_by.count(victim.address) >= 4, served_by  # the drain was not idle
    assert all(sum(len(c.token_ids) for c in o.chunks) == LONG["max_tokens"] for o, _ in running)
    assert_exits_by_itself(victim, sigterm_at)
    stack.wait_no_leaks()


def encode_request() -> encoder_pb2.EncodeRequest:
    message = common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="Hi")])
    return encoder_pb2.EncodeRequest(room=12345, request_id="direct", messages=[message])


def test_sigterm_an_encoder_with_rooms_queued_and_in_transfer(
    tiny_model_dir, stack_factory
) -> None:
    """Image requests of 448x448 noise (every one distinct: no cache hits), so that the
    encoder holds rooms in every state when SIGTERM comes: queued for the ViT, waiting for
    blocks, held by the sender for the language worker. The encoders take as many Encode calls
    at once as there are requests (the survivor alone gets them all once the victim left)."""
    worker_args = (*WORKER_ARGS, "--grpc-workers", str(NUM_REQUESTS + 8))
    stack = stack_factory(tiny_model_dir(ARCH), num_encoders=2, worker_args=worker_args)
    victim, survivor = stack.encoders
    images = [png_bytes(noise_image(300 + i, 448)) for i in range(NUM_REQUESTS)]
    with stack.client() as client, ThreadPoolExecutor(NUM_REQUESTS + 8) as pool:
        running = [
            stream_in_background(
                pool,
                client,
                f"Picture {i}?",
                [images[i]],
                max_tokens=16,
                ignore_eos=True,
                timeout=120,
            )  # fmt: skip
            for i in range(NUM_REQUESTS)
        ]
        queued = wait_for(
            lambda: stack.encoder_load(0).num_queued_requests, 60, "rooms queued on the victim"
        )
        sigterm_at = time.monotonic()
        victim.kill(signal.SIGTERM)

        wait_for(lambda: victim.address not in registered(stack, "encoder"), 5, "deregistered")
        fresh = [png_bytes(noise_image(900 + i, 112)) for i in range(6)]
        new = [pool.submit(client.generate, "New?", [image], max_tokens=4) for image in fresh]
        assert {f.result(timeout=120).encoder for f in new} == {survivor.address}
        with stack.channel(victim.address) as channel:
            stub = encoder_pb2_grpc.EncoderStub(channel)
            details = wait_for(
                lambda: refused_while_draining(lambda: stub.Encode(encode_request(), timeout=10)),
                5,
                "the victim refusing new work",
            )
            assert details == "encoder is draining: retry on another"
            stub.GetLoad(encoder_pb2.GetLoadRequest(), timeout=5)  # other calls still answer

        served_by = [final(outcome).encoder for outcome, done in running if done.result(150)]
    assert queued >= 1
    assert served_by.count(victim.address) >= 2, served_by  # it finished rooms it had accepted
    assert_exits_by_itself(victim, sigterm_at)
    (line,) = [x for x in victim.log_path.read_text().splitlines() if "rooms to finish" in x]
    assert int(line.split("draining: ")[1].split()[0]) >= 1, line  # rooms were still in flight
    stack.wait_no_leaks()


@pytest.mark.parametrize("role", ["encoder", "language"])
def test_an_idle_worker_drains_at_once(role: str, tiny_model_dir, stack_factory) -> None:
    """Nothing in flight: SIGTERM to exit takes about the deregistration's settle time, and the
    gateway forgets the worker at once (not after its expiry)."""
    stack = stack_factory(tiny_model_dir(ARCH), worker_args=WORKER_ARGS)
    proc = stack.encoders[0] if role == "encoder" else stack.languages[0]
    sigterm_at = time.monotonic()
    proc.kill(signal.SIGTERM)
    wait_for(lambda: proc.address not in registered(stack, role), 2, "deregistered")
    assert assert_exits_by_itself(proc, sigterm_at) < 10
