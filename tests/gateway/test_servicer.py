"""The public servicer over real gRPC, in-process gateway without workers: bad requests are
refused with INVALID_ARGUMENT before admission and counted under that code."""

from __future__ import annotations

import grpc
import pytest

from protos.epd.v1 import gateway_pb2_grpc
from services.gateway.client import build_request
from services.gateway.config import GatewayConfig
from services.gateway.server import serve


@pytest.fixture
def gateway():
    handle = serve(GatewayConfig(port=0, max_queued=1, max_images=2))
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield handle, gateway_pb2_grpc.GatewayStub(channel)
    channel.close()
    handle.stop(0)


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
    ]
    needles = ["sampling.temperature", "sampling.temperature", "limit of 2 images", "max_new"]
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
