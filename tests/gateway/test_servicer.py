"""The public servicer over real gRPC, in-process gateway without workers: bad requests are
refused with INVALID_ARGUMENT before admission and counted under that code; Abort reaches only
the caller's own requests."""

from __future__ import annotations

import hashlib

import grpc
import pytest

from protos.epd.v1 import gateway_pb2_grpc
from protos.epd.v1.gateway_pb2 import AbortRequest
from services.gateway.client import build_request
from services.gateway.config import GatewayConfig
from services.gateway.servicer import caller_identity


@pytest.fixture
def gateway(gateway_factory):
    handle = gateway_factory(GatewayConfig(max_queued=1, max_images=2))
    with grpc.insecure_channel(handle.address) as channel:
        yield handle, gateway_pb2_grpc.GatewayStub(channel)


def outcomes(handle) -> dict[str, float]:
    return {
        s.labels["outcome"]: s.value
        for metric in handle.metrics.registry.collect()
        if metric.name == "epd_gateway_requests"
        for s in metric.samples
        if s.name.endswith("_total")
    }


def test_validation_errors_are_invalid_argument_and_counted(gateway) -> None:
    handle, stub = gateway
    bad = [
        build_request("hi", temperature=float("nan")),
        build_request("hi", temperature=1e-45),
        build_request("hi", [b"a", b"b", b"c"]),  # max_images=2
        build_request("hi", max_tokens=1 << 20),
        build_request("hi", frequency_penalty=-3.0),
        build_request("hi", logit_bias={4: float("inf")}),
        build_request("hi", n=17),
    ]
    needles = [
        "sampling.temperature",
        "sampling.temperature",
        "limit of 2 images",
        "max_new",
        "sampling.frequency_penalty must be a finite number in [-2, 2], got -3",
        "sampling.logit_bias values must be finite numbers in [-100, 100], got inf",
        "sampling.n must be in [0, 16] (0 or 1 = one choice), got 17",
    ]
    for request, needle in zip(bad, needles, strict=True):
        for rpc in (stub.GenerateUnary, lambda r, **kw: list(stub.Generate(r, **kw))):
            with pytest.raises(grpc.RpcError) as info:
                rpc(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in info.value.details()
    assert outcomes(handle) == {"INVALID_ARGUMENT": 2.0 * len(bad)}
    assert handle.admission.num_in_flight == 0
    # a valid request gets past validation (max_queued=1 was never taken by the bad ones) and
    # fails only for want of workers
    with pytest.raises(grpc.RpcError) as info:
        stub.GenerateUnary(build_request("hi"), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no healthy language worker" in info.value.details()
    assert outcomes(handle)["UNAVAILABLE"] == 1.0


def test_abort_reaches_only_requests_of_the_same_api_key(gateway) -> None:
    handle, stub = gateway
    owner = "key:" + hashlib.sha256(b"key-one").hexdigest()
    job = handle.admission.admit("job-1", owner=owner)
    for metadata in ((("authorization", "Bearer key-two"),), None):
        with pytest.raises(grpc.RpcError) as info:
            stub.Abort(AbortRequest(request_id="job-1"), metadata=metadata, timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "'job-1'" in info.value.details()
    assert not job.cancelled
    reply = stub.Abort(
        AbortRequest(request_id="job-1"), metadata=(("authorization", "bearer key-one"),), timeout=5
    )
    assert reply.aborted and job.cancelled
    for bad, needle in (("", "request_id is required"), ("x" * 300, "at most 256")):
        with pytest.raises(grpc.RpcError) as info:
            stub.Abort(AbortRequest(request_id=bad), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in info.value.details()


def test_caller_identity() -> None:
    class Context:
        def __init__(self, metadata) -> None:
            self.metadata = metadata

        def invocation_metadata(self):
            return self.metadata

        def peer(self) -> str:
            return "ipv4:10.0.0.1:4242"

    digest = hashlib.sha256(b"s3cret").hexdigest()
    assert caller_identity(Context([("authorization", "Bearer s3cret")])) == f"key:{digest}"
    assert caller_identity(Context([("x", "y"), ("authorization", " BEARER  s3cret ")])) == (
        f"key:{digest}"
    )
    assert caller_identity(Context([("authorization", "Basic abc")])) == "peer:ipv4:10.0.0.1:4242"
    assert caller_identity(Context([])) == "peer:ipv4:10.0.0.1:4242"
