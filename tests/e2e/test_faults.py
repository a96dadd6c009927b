"""Faults through a real stack: dead and silent workers, cancellation, deadlines, backpressure.

Every affected request must end with one clear gRPC status within its deadline, the rest keep
succeeding, and afterwards the live workers hold no rooms, transfer blocks or KV slots (checked
through their GetLoad RPCs). Tests that kill a worker get their own stack; the others share one.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest

from common.procs import ServiceProcess
from protos.epd.v1 import common_pb2, gateway_pb2
from services.gateway.client import GatewayClient, build_request
from tests.e2e.conftest import Stack, noise_image, png_bytes, start_stack

ARCH = "qwen2_5_vl"
MAX_TOKENS = 8
LONG = {"max_tokens": 2000, "ignore_eos": True}  # ~8 s of decode on the test checkpoint
SMALL_IMAGE = png_bytes(noise_image(1, 112))


@dataclass
class Outcome:
    """How one streamed request ended."""

    chunks: list[gateway_pb2.GenerateChunk] = field(default_factory=list)
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    elapsed_s: float = 0.0
    first_chunk: threading.Event = field(default_factory=threading.Event)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


def consume(call: Iterator[gateway_pb2.GenerateChunk], outcome: Outcome) -> Outcome:
    start = time.monotonic()
    try:
        for chunk in call:
            outcome.chunks.append(chunk)
            outcome.first_chunk.set()
    except grpc.RpcError as exc:
        outcome.code, outcome.details = exc.code(), exc.details() or ""
    outcome.elapsed_s = time.monotonic() - start
    outcome.first_chunk.set()
    return outcome


def stream_in_background(
    pool: ThreadPoolExecutor, client: GatewayClient, prompt: str, images=(), **kw
) -> tuple[Outcome, object]:
    outcome = Outcome()
    call = client.generate_stream(prompt, list(images), **kw)
    return outcome, pool.submit(consume, call, outcome)


def wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def free_blocks(stack: Stack) -> dict[str, int]:
    return {
        proc.name: stack.language_load(i).num_free_transfer_blocks
        for i, proc in enumerate(stack.languages)
        if proc.alive()
    }


def assert_clean(stack: Stack, initial_blocks: dict[str, int], timeout_s: float = 30.0) -> None:
    """No leaks on live workers and every language worker's transfer blocks back."""
    stack.wait_no_leaks(timeout_s)
    live = {k: v for k, v in initial_blocks.items() if k in free_blocks(stack)}
    wait_for(lambda: free_blocks(stack) == live, timeout_s, f"transfer blocks {live} free")
    assert all(v > 0 for v in live.values()), live


def assert_serving(stack: Stack, images=(SMALL_IMAGE,), seed: int = 0) -> None:
    """An image request and a text-only request both succeed."""
    with stack.client() as client:
        reply = client.generate(
            f"Still there? {seed}", [*images], max_tokens=MAX_TOKENS, timeout=60
        )
        assert reply.finish_reason in (
            common_pb2.FINISH_REASON_STOP,
            common_pb2.FINISH_REASON_LENGTH,
        )
        assert reply.token_ids and (reply.encoder or not images)
        text = client.generate(f"Text only {seed}", max_tokens=MAX_TOKENS, timeout=60)
        assert text.token_ids and text.encoder == ""


def encoder_in_flight(stack: Stack) -> str:
    for w in stack.workers():
        if w.role == "encoder" and w.in_flight:
            return w.address
    return ""


def language_in_flight(stack: Stack) -> str:
    for w in stack.workers():
        if w.role == "language" and w.in_flight:
            return w.address
    return ""


def healthy_addresses(stack: Stack, role: str) -> set[str]:
    return {w.address for w in stack.workers() if w.role == role and w.healthy}


def by_address(procs: list[ServiceProcess], address: str) -> ServiceProcess:
    return next(p for p in procs if p.address == address)


# ---- workers dying ----------------------------------------------------------------------


def test_encoder_killed_mid_transfer(tiny_model_dir, stack_factory) -> None:
    """Two encoders, 128-token default buffer; the encoder serving a 3-image request (~6,100
    prompt tokens, a continuation) dies while the language worker is still receiving."""
    stack = stack_factory(
        tiny_model_dir(ARCH), num_encoders=2, env={"EPD_TRANSFER_DEFAULT_TOKENS": "128"}
    )
    initial = free_blocks(stack)
    images = [png_bytes(noise_image(100 + i, 1344)) for i in range(3)]
    with stack.client() as client, ThreadPoolExecutor(2) as pool:
        outcome, done = stream_in_background(
            pool, client, "Describe the three pictures.", images, max_tokens=MAX_TOKENS, timeout=30
        )
        address = wait_for(lambda: encoder_in_flight(stack), 20, "the encoder to accept")
        victim = by_address(stack.encoders, address)
        victim.kill(signal.SIGSTOP)  # freeze it first, then check it really was mid-way
        try:
            receiving = stack.language_load().num_receiving
        finally:
            victim.kill(signal.SIGKILL)
        assert receiving == 1, "the request finished receiving before the encoder was killed"
        done.result(timeout=40)
    assert outcome.code == grpc.StatusCode.UNAVAILABLE, (outcome.code, outcome.details)
    # "language worker ADDR: room N: sender_dead: tcp://... silent"
    assert "language worker" in outcome.details and "sender_dead" in outcome.details
    assert outcome.elapsed_s < 30
    assert outcome.num_tokens == 0
    victim.proc.wait(10)

    with stack.client() as client:
        survivor = next(p for p in stack.encoders if p is not victim).address
        wait_for(
            lambda: healthy_addresses(stack, "encoder") == {survivor}, 10, "dead encoder dropped"
        )
        # the same large request goes to the survivor, with its continuation
        reply = client.generate(
            "Describe the three pictures.", images, max_tokens=MAX_TOKENS, timeout=60
        )
        assert reply.encoder == survivor and reply.timing.num_transfers >= 2
    for i in range(2):
        assert_serving(stack, images=(png_bytes(noise_image(150 + i)),), seed=i)
    assert_clean(stack, initial)


def test_language_killed_mid_decode(tiny_model_dir, stack_factory) -> None:
    stack = stack_factory(tiny_model_dir(ARCH), num_languages=2)
    with stack.client() as client, ThreadPoolExecutor(2) as pool:
        outcome, done = stream_in_background(
            pool, client, "Tell a long story.", [SMALL_IMAGE], timeout=60, **LONG
        )
        assert outcome.first_chunk.wait(30) and outcome.chunks, outcome.details
        address = wait_for(lambda: language_in_flight(stack), 5, "the language worker")
        victim = by_address(stack.languages, address)
        assert stack.language_load(stack.languages.index(victim)).num_running == 1
        victim.kill()
        done.result(timeout=30)
        assert outcome.code == grpc.StatusCode.UNAVAILABLE, (outcome.code, outcome.details)
        assert address in outcome.details
        assert 0 < outcome.num_tokens < LONG["max_tokens"]
        assert not any(c.finish_reason for c in outcome.chunks)

        survivor = next(p for p in stack.languages if p is not victim).address
        wait_for(
            lambda: healthy_addresses(stack, "language") == {survivor}, 10, "dead worker dropped"
        )
    for i in range(3):
        assert_serving(stack, images=(SMALL_IMAGE, png_bytes(noise_image(200 + i))), seed=i)
    with stack.client() as client:
        reply = client.generate("x", [SMALL_IMAGE], max_tokens=MAX_TOKENS, timeout=30)
        assert reply.language == survivor
    stack.wait_no_leaks()  # encoder: no rooms, no blocks; the surviving language worker: idle


# ---- one stack shared by the tests that kill nothing --------------------------------------


@pytest.fixture(scope="module")
def shared(tiny_model_dir, tmp_path_factory) -> Iterator[Stack]:
    stack = start_stack(
        tiny_model_dir(ARCH),
        tmp_path_factory.mktemp("faults"),
        gateway_args=("--max-queued", "3"),
    )
    stack.initial_blocks = free_blocks(stack)  # type: ignore[attr-defined]
    yield stack
    for proc in stack.procs:
        proc.kill(signal.SIGCONT)
    stack.stop()


def test_client_cancel_mid_stream_frees_everything(shared: Stack) -> None:
    for images in ([], [SMALL_IMAGE]):
        with shared.client() as client:
            call = client.generate_stream("Cancel me.", images, timeout=60, **LONG)
            first = next(call)
            assert first.token_ids
            assert shared.language_load().num_running == 1
            call.cancel()
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.CANCELLED
        # the language worker notices and drops the request long before its 2,000 tokens
        wait_for(lambda: shared.language_load().num_running == 0, 5, "the request to be freed")
        assert_clean(shared, shared.initial_blocks)


@pytest.mark.parametrize("images", [[], [SMALL_IMAGE]], ids=["text", "image"])
def test_abort_by_request_id(shared: Stack, images: list[bytes]) -> None:
    request_id = f"abort-me-{len(images)}"
    with shared.client() as client, ThreadPoolExecutor(1) as pool:
        outcome, done = stream_in_background(
            pool, client, "Abort me.", images, timeout=60, request_id=request_id, **LONG
        )
        assert outcome.first_chunk.wait(30) and outcome.chunks, outcome.details
        start = time.monotonic()
        assert client.abort(request_id) is True
        done.result(timeout=30)
        assert outcome.code == grpc.StatusCode.CANCELLED, (outcome.code, outcome.details)
        assert time.monotonic() - start < 5, "abort took effect only when the stream ended"
        assert outcome.num_tokens < LONG["max_tokens"]
        with pytest.raises(grpc.RpcError) as info:
            client.abort(request_id)  # finished: no longer in flight
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert_clean(shared, shared.initial_blocks)


def test_abort_unknown_request_is_not_found(shared: Stack) -> None:
    with shared.client() as client:
        with pytest.raises(grpc.RpcError) as info:
            client.abort("no-such-request")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no-such-request" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            client.abort("")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("images", [[], [SMALL_IMAGE]], ids=["text", "image"])
def test_deadline_expiry(shared: Stack, images: list[bytes]) -> None:
    with shared.client() as client:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            client.generate("Too slow.", images, timeout=0.8, **LONG)
        elapsed = time.monotonic() - start
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed < 2.0
    wait_for(lambda: shared.language_load().num_running == 0, 5, "the request to be freed")
    assert_clean(shared, shared.initial_blocks)


def test_queue_full_is_rejected_at_once(shared: Stack) -> None:
    """``--max-queued 3``: of 8 concurrent long requests, the excess is refused immediately."""
    shared.wait_no_leaks()
    with shared.client() as client, ThreadPoolExecutor(8) as pool:
        started = [
            stream_in_background(
                pool,
                client,
                f"Request {i}",
                [SMALL_IMAGE] if i % 2 else [],
                timeout=60,
                max_tokens=300,
                ignore_eos=True,
            )
            for i in range(8)
        ]
        outcomes = [done.result(timeout=60) for _, done in started]
    rejected = [o for o in outcomes if o.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    ok = [o for o in outcomes if o.code == grpc.StatusCode.OK]
    assert len(rejected) + len(ok) == 8, [(o.code, o.details) for o in outcomes]
    assert 1 <= len(ok) <= 3 + 1 and len(rejected) >= 4, (len(ok), len(rejected))
    for o in rejected:
        assert "queue is full" in o.details and o.elapsed_s < 1.0 and not o.chunks
    for o in ok:
        assert o.num_tokens == 300 and o.chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert_clean(shared, shared.initial_blocks)


def _request(**kw) -> gateway_pb2.GenerateRequest:
    return build_request("Hi", max_tokens=MAX_TOKENS, **kw)


def test_bad_inputs_are_invalid_argument(shared: Stack) -> None:
    empty = gateway_pb2.GenerateRequest()
    bad_role = _request()
    bad_role.messages[0].role = "robot"
    empty_part = _request()
    empty_part.messages[0].content.add()
    no_source = _request()
    no_source.messages[0].content.add().image.SetInParent()
    cases = {
        "corrupt image": (build_request("Hi", [b"\x89PNG not really"], max_tokens=4), "image"),
        "empty messages": (empty, "messages must not be empty"),
        "bad role": (bad_role, "robot"),
        "empty content part": (empty_part, "content[1] is empty"),
        "image without source": (no_source, "no source"),
        "negative temperature": (_request(temperature=-1.0), "temperature"),
        "top_p above 1": (_request(top_p=1.5), "top_p"),
    }
    with shared.client() as client:
        for name, (request, needle) in cases.items():
            for rpc in (client.stub.Generate, client.stub.GenerateUnary):
                with pytest.raises(grpc.RpcError) as info:
                    reply = rpc(request, timeout=30)
                    list(reply) if rpc is client.stub.Generate else None
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                assert needle in info.value.details(), (name, info.value.details())
    assert_serving(shared)
    assert_clean(shared, shared.initial_blocks)


def test_encoder_that_never_answers(shared: Stack) -> None:
    """SIGSTOP the only encoder: image requests end within their deadline, text keeps going."""
    encoder = shared.encoders[0]
    with shared.client() as client, ThreadPoolExecutor(1) as pool:
        encoder.kill(signal.SIGSTOP)
        try:
            image = png_bytes(noise_image(300))
            outcome, done = stream_in_background(
                pool, client, "Anyone?", [image], max_tokens=MAX_TOKENS, timeout=4
            )
            text = client.generate("Text still works", max_tokens=MAX_TOKENS, timeout=30)
            assert text.token_ids and text.language
            done.result(timeout=10)
            assert outcome.code in (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNAVAILABLE,
            ), (outcome.code, outcome.details)
            assert outcome.elapsed_s < 4.5 and not outcome.chunks
            # the gateway stops routing to it: fail fast instead of waiting out deadlines
            wait_for(lambda: not healthy_addresses(shared, "encoder"), 10, "encoder unhealthy")
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                client.generate("Anyone?", [image], max_tokens=MAX_TOKENS, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no healthy encoder worker" in info.value.details()
            assert time.monotonic() - start < 1.0
        finally:
            encoder.kill(signal.SIGCONT)
        shared.wait_registered(30)
    assert_serving(shared, images=(SMALL_IMAGE, png_bytes(noise_image(301))))
    assert_clean(shared, shared.initial_blocks)


# ---- no workers at all ----------------------------------------------------------------------


def test_gateway_without_workers_is_unavailable(tiny_model_dir, stack_factory) -> None:
    stack = stack_factory(tiny_model_dir(ARCH), num_encoders=0, num_languages=0)
    with stack.client() as client:
        assert stack.workers() == []
        for images in ([], [SMALL_IMAGE]):
            with pytest.raises(grpc.RpcError) as info:
                client.generate("Hello?", images, max_tokens=4, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no healthy language worker" in info.value.details()
