"""An in-process gateway for the gateway's own tests: its real servicers on a real gRPC server
bound to a free port on 127.0.0.1, built from the gateway's parts (not ``server.py``, whose ports
and credentials are configured elsewhere)."""

from __future__ import annotations

import time
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest

from protos.epd.v1 import gateway_pb2_grpc, registry_pb2_grpc
from services.gateway.admission import Admission
from services.gateway.config import GatewayConfig
from services.gateway.frontdoor import FrontDoor
from services.gateway.metrics import GatewayMetrics
from services.gateway.orchestrator import Orchestrator
from services.gateway.registry import Role, WorkerRegistry
from services.gateway.routing import create_policy
from services.gateway.servicer import GatewayServicer, RegistryServicer
from services.gateway.workers import create_channel


@dataclass
class InProcessGateway:
    server: grpc.Server
    port: int
    config: GatewayConfig
    registry: WorkerRegistry
    admission: Admission
    metrics: GatewayMetrics

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(0).wait()
        self.registry.close()


def start_gateway(config: GatewayConfig | None = None) -> InProcessGateway:
    """Gateway and registry services on one port (tests only)."""
    config = config or GatewayConfig()
    registry = WorkerRegistry(config.worker_expiry_s, create_channel)
    metrics = GatewayMetrics(registry)
    admission = Admission(config.max_queued)
    orchestrator = Orchestrator(
        config,
        registry,
        create_policy(config.encoder_policy, Role.ENCODER, config.affinity_slack),
        create_policy(config.language_policy, Role.LANGUAGE, config.affinity_slack),
        metrics,
    )
    server = grpc.server(futures.ThreadPoolExecutor(8), options=[("grpc.so_reuseport", 0)])
    front_door = FrontDoor(config, admission, orchestrator, metrics)
    gateway_pb2_grpc.add_GatewayServicer_to_server(
        GatewayServicer(config, front_door, registry), server
    )
    registry_pb2_grpc.add_WorkerRegistryServicer_to_server(
        RegistryServicer(registry, config.heartbeat_interval_s), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return InProcessGateway(server, port, config, registry, admission, metrics)


@pytest.fixture
def gateway_factory():
    """``gateway_factory(config=None)`` starts an in-process gateway, stopped after the test."""
    started: list[InProcessGateway] = []

    def make(config: GatewayConfig | None = None) -> InProcessGateway:
        started.append(start_gateway(config))
        return started[-1]

    yield make
    for gateway in started:
        gateway.stop()


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    """Return once ``predicate()`` holds; fail the test when it does not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)
