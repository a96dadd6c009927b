"""The gateway's request path through a real stack: bad sampling is refused without disturbing
another client's stream, a live request id belongs to its request and its caller, and a client
moves on from a gateway that is down."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.procs import free_port
from protos.epd.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    language_pb2,
    language_pb2_grpc,
)
from services.gateway.client import GatewayClient, build_request
from services.gateway.workers import create_channel
from tests.e2e.conftest import Stack, noise_image, png_bytes, start_stack
from tests.e2e.test_faults import Outcome, consume, stream_in_background, wait_for

ARCH = "qwen2_5_vl"
LONG = {"max_tokens": 400, "ignore_eos": True}  # a stream that outlives the checks beside it
IMAGE = png_bytes(noise_image(11, 112))


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory) -> Iterator[Stack]:
    stack = start_stack(tiny_model_dir(ARCH), tmp_path_factory.mktemp("gateway-requests"))
    yield stack
    stack.stop()


def assert_completed(outcome, max_tokens: int) -> None:
    assert outcome.code == grpc.StatusCode.OK, (outcome.code, outcome.details)
    assert outcome.num_tokens == max_tokens
    assert outcome.chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_bad_temperatures_are_refused_while_another_stream_completes(stack: Stack) -> None:
    with stack.client() as busy, stack.client() as other, ThreadPoolExecutor(1) as pool:
        outcome, done = stream_in_background(pool, busy, "Go on.", [IMAGE], timeout=120, **LONG)
        assert outcome.first_chunk.wait(60) and outcome.chunks, outcome.details
        for temperature in (float("nan"), 1e-45):
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                other.generate("Hi", [IMAGE], max_tokens=4, temperature=temperature, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sampling.temperature must be" in info.value.details()
            assert time.monotonic() - start < 1.0  # refused at the door, not by a worker
            with pytest.raises(grpc.RpcError) as info:
                list(other.generate_stream("Hi", max_tokens=4, temperature=temperature))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not done.done(), "the long stream should still be running"
        done.result(timeout=120)
    assert_completed(outcome, LONG["max_tokens"])
    stack.wait_no_leaks()


def separate_caller(address: str) -> tuple[grpc.Channel, gateway_pb2_grpc.GatewayStub]:
    """A channel with its own connection: another peer to the gateway.

    NOTE: grpcio shares connections between channels of one process with the same target and
    arguments, so two plain clients here would be one peer.
    """
    channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    return channel, gateway_pb2_grpc.GatewayStub(channel)


def test_a_live_request_id_belongs_to_its_request_and_caller(stack: Stack) -> None:
    channel, stranger = separate_caller(stack.gateway.address)
    with channel, stack.client() as owner, ThreadPoolExecutor(1) as pool:
        outcome, done = stream_in_background(
            pool, owner, "Mine.", timeout=120, request_id="shared-id", **LONG
        )
        assert outcome.first_chunk.wait(60) and outcome.chunks, outcome.details
        # another caller reusing the id is refused, alone
        with pytest.raises(grpc.RpcError) as info:
            request = build_request("Theirs.", max_tokens=4, request_id="shared-id")
            stranger.GenerateUnary(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "'shared-id' is already in flight" in info.value.details()
        # nor can it abort it: to another caller the request does not exist
        with pytest.raises(grpc.RpcError) as info:
            stranger.Abort(gateway_pb2.AbortRequest(request_id="shared-id"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        # the language worker never heard of the client's id
        with create_channel(stack.languages[0].address) as worker:
            found = language_pb2_grpc.LanguageServiceStub(worker).Abort(
                language_pb2.LanguageAbortRequest(request_id="shared-id"), timeout=5
            )
        assert not found.found
        seen = outcome.num_tokens
        wait_for(lambda: outcome.num_tokens > seen, 30, "the stream to keep going")
        assert not done.done()
        assert owner.abort("shared-id") is True
        done.result(timeout=30)
    assert outcome.code == grpc.StatusCode.CANCELLED, (outcome.code, outcome.details)
    assert outcome.num_tokens < LONG["max_tokens"]
    stack.wait_no_leaks()


def test_abort_with_the_same_api_key_from_another_connection(stack: Stack) -> None:
    channel, elsewhere = separate_caller(stack.gateway.address)
    abort = gateway_pb2.AbortRequest(request_id="keyed-id")
    with (
        channel,
        GatewayClient(stack.gateway.address, api_key="team-a") as team_a,
        GatewayClient(stack.gateway.address, api_key="team-b") as team_b,
        ThreadPoolExecutor(1) as pool,
    ):
        outcome, done = stream_in_background(
            pool, team_a, "Keyed.", [IMAGE], timeout=120, request_id="keyed-id", **LONG
        )
        assert outcome.first_chunk.wait(60) and outcome.chunks, outcome.details
        for caller in (lambda: team_b.abort("keyed-id"), lambda: elsewhere.Abort(abort, timeout=5)):
            with pytest.raises(grpc.RpcError) as info:
                caller()  # another key on the same connection, or no key on another one
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert not done.done()
        key = (("authorization", "Bearer team-a"),)
        assert elsewhere.Abort(abort, metadata=key, timeout=5).aborted  # same key, elsewhere
        done.result(timeout=30)
    assert outcome.code == grpc.StatusCode.CANCELLED, (outcome.code, outcome.details)
    stack.wait_no_leaks()


def test_client_moves_on_from_a_gateway_that_is_down(stack: Stack) -> None:
    dead = f"127.0.0.1:{free_port()}"
    with GatewayClient([dead, stack.gateway.address]) as client:
        reply = client.generate("Hello", [IMAGE], max_tokens=6, ignore_eos=True, timeout=60)
        assert len(reply.token_ids) == 6 and reply.encoder and reply.language
        call = client.generate_stream("Hello again", max_tokens=6, ignore_eos=True, timeout=60)
        assert_completed(consume(call, Outcome()), 6)
