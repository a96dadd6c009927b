"""The gateway's two surfaces, seen by a client nobody here wrote (grpcurl): the public port
serves the API and no registry; the registry port serves the registry and no API."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.common.grpcurl import grpcurl, needs_grpcurl, ok, refused
from tests.e2e.conftest import Stack, start_stack

pytestmark = needs_grpcurl
REGISTRY_PROTO = "protos/epd/v1/registry.proto"
GATEWAY_PROTO = "protos/epd/v1/gateway.proto"
REGISTRY_METHODS = {
    "Heartbeat": {"address": "127.0.0.1:9", "role": "encoder", "capacity": 1},
    "Deregister": {"address": "127.0.0.1:9"},
    "ListWorkers": {},
}


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory) -> Iterator[Stack]:
    stack = start_stack(tiny_model_dir("qwen2_vl"), tmp_path_factory.mktemp("surfaces"))
    yield stack
    stack.stop()


def workers(stack: Stack) -> dict[str, dict]:
    out = ok(grpcurl(stack.registry_address, "epd.v1.WorkerRegistry/ListWorkers"))
    return {w["address"]: w for w in json.loads(out).get("workers", [])}


def test_public_port_lists_no_registry(stack: Stack) -> None:
    services = set(ok(grpcurl(stack.gateway.address, "list")).split())
    assert services == {
        "epd.v1.Gateway",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }


@pytest.mark.parametrize("method", sorted(REGISTRY_METHODS))
def test_registry_calls_on_the_public_port_are_unimplemented(stack: Stack, method: str) -> None:
    proc = grpcurl(
        stack.gateway.address,
        f"epd.v1.WorkerRegistry/{method}",
        data=REGISTRY_METHODS[method],
        proto=REGISTRY_PROTO,
    )
    refused(proc, "Unimplemented")
    assert "127.0.0.1:9" not in workers(stack)  # the heartbeat registered nothing


def test_registry_port_serves_the_registry_and_nothing_else(stack: Stack) -> None:
    registry = stack.registry_address
    services = set(ok(grpcurl(registry, "list")).split())
    assert services == {
        "epd.v1.WorkerRegistry",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    health = json.loads(ok(grpcurl(registry, "grpc.health.v1.Health/Check")))
    assert health == {"status": "SERVING"}
    request = {"messages": [{"role": "user", "content": [{"text": "Hi"}]}]}
    refused(grpcurl(registry, "epd.v1.Gateway/Generate", data=request, proto=GATEWAY_PROTO),
            "Unimplemented")  # fmt: skip


def test_registry_port_heartbeat_list_deregister(stack: Stack) -> None:
    registry = stack.registry_address
    known = workers(stack)
    for proc in stack.encoders + stack.languages:
        assert known[proc.address]["healthy"] is True
    beat = grpcurl(registry, "epd.v1.WorkerRegistry/Heartbeat", data=REGISTRY_METHODS["Heartbeat"])
    assert json.loads(ok(beat))["interval_s"] > 0
    assert workers(stack)["127.0.0.1:9"]["role"] == "encoder"
    ok(grpcurl(registry, "epd.v1.WorkerRegistry/Deregister", data=REGISTRY_METHODS["Deregister"]))
    assert "127.0.0.1:9" not in workers(stack)
