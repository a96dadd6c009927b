"""The gateway's servers in-process: two ports with their own services, refusals counted.

No workers are needed: what is checked happens before any routing."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from common.auth import bearer_metadata
from common.channels import create_channel
from common.internal import InternalConfig
from protos.epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, registry_pb2, registry_pb2_grpc
from services.gateway.config import GatewayConfig
from services.gateway.server import serve
from tests.common.pki import write_secret


@pytest.fixture
def gateway(tmp_path: Path):
    token = write_secret(tmp_path / "token", "internal-secret")
    config = GatewayConfig(
        port=0,
        registry_port=0,
        api_keys=("user-key",),
        internal=InternalConfig(token_file=token),
    )
    handle = serve(config)
    yield handle
    handle.stop(0)


def request() -> gateway_pb2.GenerateRequest:
    message = common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="Hi")])
    return gateway_pb2.GenerateRequest(messages=[message])


def outcomes(handle) -> dict[str, float]:
    counter = handle.metrics.requests
    codes = ("UNAUTHENTICATED", "UNAVAILABLE")
    return {code: counter.labels(code, "grpc")._value.get() for code in codes}


def test_requests_without_a_key_are_refused_and_counted(gateway) -> None:
    with create_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as exc:
                stub.GenerateUnary(request(), timeout=5)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as exc:  # with a key it gets as far as routing
            stub.GenerateUnary(request(), timeout=5, metadata=bearer_metadata("user-key"))
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no healthy language worker" in exc.value.details()
    assert outcomes(gateway) == {"UNAUTHENTICATED": 2.0, "UNAVAILABLE": 1.0}


def test_the_registry_port_takes_the_internal_token_not_an_api_key(gateway) -> None:
    beat = registry_pb2.HeartbeatRequest(address="127.0.0.1:9", role="encoder", capacity=1)
    with create_channel(f"127.0.0.1:{gateway.registry_port}") as channel:
        stub = registry_pb2_grpc.WorkerRegistryStub(channel)
        for metadata in (None, bearer_metadata("user-key")):
            with pytest.raises(grpc.RpcError) as exc:
                stub.Heartbeat(beat, timeout=5, metadata=metadata)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert not gateway.registry.all()
        stub.Heartbeat(beat, timeout=5, metadata=bearer_metadata("internal-secret"))
        assert [w.address for w in gateway.registry.all()] == ["127.0.0.1:9"]
    with create_channel(f"127.0.0.1:{gateway.port}") as channel:  # not on the public port
        stub = registry_pb2_grpc.WorkerRegistryStub(channel)
        with pytest.raises(grpc.RpcError) as exc:
            stub.Heartbeat(beat, timeout=5, metadata=bearer_metadata("user-key"))
        assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
