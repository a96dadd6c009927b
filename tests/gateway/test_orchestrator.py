"""The orchestrator's calls to workers, seen from scripted workers on real gRPC servers: what the
encoder is told (internal ids, time left, prompt budget) and when a room is cancelled there.

The scripted encoder and language services answer from a script (refuse, stream, hold), so each
test pins one branch of the request's path; the real workers are exercised by the e2e tests.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from protos.epd.v1 import (
    common_pb2,
    encoder_pb2,
    encoder_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    language_pb2,
    language_pb2_grpc,
)
from services.gateway.client import build_request
from services.gateway.registry import Role, WorkerRegistry
from services.gateway.workers import (
    WorkerGone,
    cancel_room,
    create_channel,
    encode,
    generate,
    poll,
)
from tests.gateway.conftest import wait_until

LAYOUT = common_pb2.TransferLayout(hidden_size=128, dtype="bfloat16", block_size=128)
IMAGE = b"\x89PNG fake"  # the scripted encoder never decodes it


class ScriptedEncoder(encoder_pb2_grpc.EncoderServicer):
    def __init__(self) -> None:
        self.refuse: grpc.StatusCode | None = None
        self.refusals_left = -1  # with ``refuse``: how many calls it refuses (-1: all)
        self.encoded: list[encoder_pb2.EncodeRequest] = []
        self.cancelled: list[tuple[int, str]] = []
        self.cancel_seen = threading.Event()

    def Encode(self, request, context):  # noqa: N802
        self.encoded.append(request)
        if self.refuse is not None and self.refusals_left != 0:
            self.refusals_left -= 1
            context.abort(self.refuse, "scripted refusal")
        return encoder_pb2.EncodeReply(room=request.room, num_tokens=10)

    def Cancel(self, request, context):  # noqa: N802
        self.cancelled.append((request.room, request.reason))
        self.cancel_seen.set()
        return encoder_pb2.CancelReply(found=True)


class ScriptedLanguage(language_pb2_grpc.LanguageServiceServicer):
    def __init__(self) -> None:
        self.mode = "stream"  # | "refuse" | "hold" | "error"
        self.refusals_left = -1  # with "refuse": how many calls it refuses (-1: all)
        self.requests: list[language_pb2.LanguageGenerateRequest] = []
        self.holding = threading.Event()

    def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        if self.mode == "refuse" and self.refusals_left != 0:
            self.refusals_left -= 1
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "2 requests already waiting")
        if self.mode == "error":
            yield language_pb2.LanguageGenerateChunk(
                finish_reason=common_pb2.FINISH_REASON_ERROR, error="transfer failed"
            )
            return
        if self.mode == "hold":
            gone = threading.Event()
            context.add_callback(gone.set)
            self.holding.set()
            gone.wait(30)
            return
        for i in range(3):
            yield language_pb2.LanguageGenerateChunk(text=f"t{i}", token_ids=[i])
        yield language_pb2.LanguageGenerateChunk(finish_reason=common_pb2.FINISH_REASON_LENGTH)


@pytest.fixture
def pools(gateway_factory):
    encoder, language = ScriptedEncoder(), ScriptedLanguage()
    server = grpc.server(futures.ThreadPoolExecutor(8), options=[("grpc.so_reuseport", 0)])
    encoder_pb2_grpc.add_EncoderServicer_to_server(encoder, server)
    language_pb2_grpc.add_LanguageServiceServicer_to_server(language, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    gateway = gateway_factory()
    # one process plays both roles; the registry keys workers by address, so give each a name
    # that resolves to the same server
    endpoint = {"transfer_endpoint": "tcp://127.0.0.1:9"}
    gateway.registry.heartbeat(address, Role.ENCODER, 8, {}, endpoint, {"transfer_layout": LAYOUT})
    language_address = address.replace("127.0.0.1", "localhost")
    gateway.registry.heartbeat(
        language_address, Role.LANGUAGE, 8, {}, {}, {"transfer_layout": LAYOUT, "max_seq_len": 1000}
    )
    with grpc.insecure_channel(gateway.address) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel), encoder, language, gateway
    server.stop(0)


def test_workers_get_internal_ids_time_left_and_the_prompt_budget(pools) -> None:
    stub, encoder, language, _ = pools
    request = build_request("hi", [IMAGE], max_tokens=200, request_id="client-id")
    reply = stub.GenerateUnary(request, timeout=30)
    assert list(reply.token_ids) == [0, 1, 2] and reply.request_id == "client-id"
    (encoded,) = encoder.encoded
    (generated,) = language.requests
    assert encoded.limits.max_prompt_tokens == 1000 - 200
    # the caller's 30 s as the gateway's gRPC server sees it, which converts the deadline
    # between clocks: up to 0.1 s more was seen here
    assert 25 < encoded.timeout_s <= 30.5
    assert generated.room == encoded.room != 0
    ids = {encoded.request_id, generated.request_id}
    assert "client-id" not in ids and len(ids) == 2 and all(len(i) == 32 for i in ids)
    text = stub.GenerateUnary(build_request("text", request_id="client-id"), timeout=30)
    assert text.request_id == "client-id" and language.requests[-1].request_id not in ids
    time.sleep(0.3)  # a cancel would be sent at once (non-blocking): none may follow success
    assert encoder.cancelled == []


def test_a_busy_encoder_is_waited_for(pools) -> None:
    """RESOURCE_EXHAUSTED from every encoder (its stream capacity, its queue): the request waits
    at the gateway and tries again, each try with a fresh room whose language half is freed."""
    stub, encoder, language, gateway = pools
    encoder.refuse, encoder.refusals_left = grpc.StatusCode.RESOURCE_EXHAUSTED, 3
    reply = stub.GenerateUnary(build_request("hi", [IMAGE], max_tokens=8), timeout=30)
    assert list(reply.token_ids) == [0, 1, 2]
    rooms = [r.room for r in encoder.encoded]
    assert len(rooms) == 4 and len(set(rooms)) == 4
    # a refused try's language half is cancelled, possibly before it reached the worker
    assert language.requests[-1].room == rooms[-1]
    assert {r.room for r in language.requests} <= set(rooms)
    assert gateway.admission.num_in_flight == 0


def test_an_encoder_busy_past_the_deadline_is_tried_with_backoff(pools) -> None:
    stub, encoder, _, gateway = pools
    encoder.refuse = grpc.StatusCode.RESOURCE_EXHAUSTED
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        stub.GenerateUnary(build_request("hi", [IMAGE], max_tokens=8), timeout=1.5)
    assert info.value.code() in (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )
    assert time.monotonic() - start < 3
    # 20, 40, 80, ... ms apart: a handful of tries, not a spin
    assert 3 <= len(encoder.encoded) <= 10, len(encoder.encoded)
    time.sleep(0.2)
    assert gateway.admission.num_in_flight == 0


def test_an_unreachable_language_worker_is_skipped_before_anything_streamed(pools) -> None:
    """A language worker nothing listens for (killed, not yet noticed by the health poller): the
    request goes to the next one, the dead one is marked unhealthy at once, and the image
    request's first room is cancelled on the encoder."""
    from common.procs import free_port

    stub, encoder, language, gateway = pools
    dead = f"127.0.0.1:{free_port()}"  # sorts before "localhost:...": the policy's first choice
    gateway.registry.heartbeat(
        dead, Role.LANGUAGE, 8, {}, {}, {"transfer_layout": LAYOUT, "max_seq_len": 1000}
    )
    reply = stub.GenerateUnary(build_request("hi", [IMAGE], max_tokens=8), timeout=30)
    assert list(reply.token_ids) == [0, 1, 2] and reply.language != dead
    assert [w.healthy for w in gateway.registry.all() if w.address == dead] == [False]
    first, second = (r.room for r in encoder.encoded)
    assert encoder.cancel_seen.wait(5) and encoder.cancelled[0][0] == first != second
    gateway.registry.heartbeat(
        dead, Role.LANGUAGE, 8, {}, {}, {"transfer_layout": LAYOUT, "max_seq_len": 1000}
    )
    text = stub.GenerateUnary(build_request("text", max_tokens=8), timeout=30)
    assert list(text.token_ids) == [0, 1, 2] and text.language != dead
    assert gateway.admission.num_in_flight == 0


def test_a_busy_language_worker_is_waited_for(pools) -> None:
    """RESOURCE_EXHAUSTED from the language worker (its stream capacity, its queue) before it
    streamed: the request waits at the gateway and tries again with a fresh room, each refused
    try's room cancelled on the encoder; the busy worker stays healthy."""
    stub, encoder, language, gateway = pools
    language.mode, language.refusals_left = "refuse", 3
    reply = stub.GenerateUnary(build_request("hi", [IMAGE], max_tokens=8), timeout=30)
    assert list(reply.token_ids) == [0, 1, 2]
    rooms = [r.room for r in encoder.encoded]
    assert len(rooms) == 4 and len(set(rooms)) == 4
    wait_until(lambda: sorted(room for room, _ in encoder.cancelled) == sorted(rooms[:3]))
    assert all(w.healthy for w in gateway.registry.all())
    assert gateway.admission.num_in_flight == 0


def test_language_refusal_past_the_busy_wait_cancels_the_encoder_rooms(pools) -> None:
    stub, encoder, language, gateway = pools
    language.mode = "refuse"
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        stub.GenerateUnary(build_request("hi", [IMAGE], max_tokens=8), timeout=1.5)
    assert info.value.code() in (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )
    assert time.monotonic() - start < 3
    assert 3 <= len(language.requests) <= 10, len(language.requests)  # backing off, no spin
    rooms = {r.room for r in encoder.encoded}
    wait_until(lambda: {room for room, _ in encoder.cancelled} == rooms)
    assert "RESOURCE_EXHAUSTED" in encoder.cancelled[0][1]
    time.sleep(0.2)
    assert gateway.admission.num_in_flight == 0


def test_language_failure_before_any_token_cancels_the_room(pools) -> None:
    stub, encoder, language, _ = pools
    language.mode = "error"
    with pytest.raises(grpc.RpcError) as info:
        stub.GenerateUnary(build_request("hi", [IMAGE], max_tokens=8), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "transfer failed" in info.value.details()
    assert encoder.cancel_seen.wait(5)
    reason = "language worker failed: transfer failed"
    assert encoder.cancelled == [(encoder.encoded[0].room, reason)]


@pytest.mark.parametrize("how", ["client cancel", "deadline", "abort"])
def test_cancel_or_deadline_before_the_transfer_cancels_the_room(pools, how: str) -> None:
    stub, encoder, language, _ = pools
    language.mode = "hold"
    request = build_request("hi", [IMAGE], max_tokens=8, request_id="held")
    call = stub.Generate(request, timeout=1.0 if how == "deadline" else 30)
    with futures.ThreadPoolExecutor(1) as pool:
        consumer = pool.submit(lambda: list(call))
        assert language.holding.wait(10)
        if how == "client cancel":
            call.cancel()
        elif how == "abort":  # the same channel: the same caller
            stub.Abort(gateway_pb2.AbortRequest(request_id="held"), timeout=5)
        with pytest.raises(grpc.RpcError) as info:
            consumer.result(timeout=10)
    expected = {
        "client cancel": grpc.StatusCode.CANCELLED,
        "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
        "abort": grpc.StatusCode.CANCELLED,
    }
    assert info.value.code() == expected[how]
    assert encoder.cancel_seen.wait(5)
    # the room of this request, whether or not its Encode call got there before the cancel
    assert [room for room, _ in encoder.cancelled] == [language.requests[0].room]


def test_encoder_refusal_is_not_cancelled_back(pools) -> None:
    stub, encoder, language, _ = pools
    encoder.refuse = grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        stub.GenerateUnary(build_request("hi", [IMAGE], max_tokens=8), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "scripted refusal" in info.value.details()
    time.sleep(0.3)
    assert encoder.cancelled == []  # the encoder failed the room itself


def test_max_new_tokens_that_cannot_fit_is_refused_before_any_worker_call(pools) -> None:
    stub, encoder, language, _ = pools
    with pytest.raises(grpc.RpcError) as info:
        stub.GenerateUnary(build_request("hi", [IMAGE], max_tokens=1000), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_new_tokens is 1000" in info.value.details()
    assert "max_seq_len 1000" in info.value.details()
    assert encoder.encoded == [] and language.requests == []


def test_calls_to_a_dropped_worker_fail_cleanly() -> None:
    """The registry closes a dropped worker's channel while requests may still hold the worker;
    calls through it then fail as UNAVAILABLE (and a cancel is skipped), the process lives on."""
    registry = WorkerRegistry(5.0, create_channel)
    for address, role in (("127.0.0.1:1", Role.ENCODER), ("127.0.0.1:2", Role.LANGUAGE)):
        registry.heartbeat(address, role, 8, {})
    encoder, language = sorted(registry.all(), key=lambda w: w.address)
    assert registry.deregister(encoder.address) and registry.deregister(language.address)
    assert cancel_room(encoder, 5, "request cancelled") is None
    with pytest.raises(WorkerGone) as info:
        encode(encoder, 5, "id", [], 1.0)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "127.0.0.1:1 left the pool" in info.value.details()
    with pytest.raises(WorkerGone):
        generate(language, "id", common_pb2.SamplingParams(), 1.0)
    assert poll(encoder, 1.0) == (False, {}, {}, {})
