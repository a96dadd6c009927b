"""``epd serve gateway``: the public API and the worker registry on one gRPC port.

``serve(config)`` starts everything in-process and returns a ``GatewayServer``; a background
thread polls every known worker's health and load and drops self-registered workers that went
silent.
"""

from __future__ import annotations

import argparse
import logging
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from common.cli_config import add_cli_args, from_cli_args
from common.grpc_server import Running, create_server, serve_until_terminated, start_server
from protos.epd.v1 import gateway_pb2, gateway_pb2_grpc, registry_pb2, registry_pb2_grpc
from services.gateway import workers as calls
from services.gateway.admission import Admission
from services.gateway.config import ENV_PREFIX, GatewayConfig
from services.gateway.metrics import GatewayMetrics
from services.gateway.orchestrator import Orchestrator
from services.gateway.registry import Role, WorkerRegistry
from services.gateway.routing import create_policy
from services.gateway.servicer import GatewayServicer, RegistryServicer

logger = logging.getLogger(__name__)
SERVICE_NAMES = (
    gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name,
    registry_pb2.DESCRIPTOR.services_by_name["WorkerRegistry"].full_name,
)


class HealthPoller:
    """Polls each worker's grpc.health + load every ``period_s``; expires silent workers."""

    def __init__(self, registry: WorkerRegistry, period_s: float) -> None:
        self._registry = registry
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="health-poller", daemon=True)
        self._pool = futures.ThreadPoolExecutor(8, thread_name_prefix="health-poll")
        self._thread.start()

    def _poll(self, worker) -> None:
        healthy, load, info, descriptor = calls.poll(worker, timeout_s=max(self._period_s, 0.5))
        self._registry.mark(worker.address, healthy, load or None, info or None, descriptor)

    def _loop(self) -> None:
        while not self._stop.wait(self._period_s):
            list(self._pool.map(self._poll, self._registry.all()))
            for address in self._registry.expire():
                logger.warning("worker %s went silent; dropped", address)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class GatewayServer:
    server: grpc.Server
    port: int
    registry: WorkerRegistry
    admission: Admission
    metrics: GatewayMetrics
    poller: HealthPoller
    health: health.HealthServicer

    def stop(self, grace_s: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.poller.stop()
        self.server.stop(grace_s).wait()
        self.registry.close()


def serve(config: GatewayConfig) -> GatewayServer:
    registry = WorkerRegistry(
        config.worker_expiry_s, lambda address: calls.create_channel(address, config.max_message_mb)
    )
    for address in config.encoders:
        registry.add_static(address, Role.ENCODER)
    for address in config.languages:
        registry.add_static(address, Role.LANGUAGE)
    metrics = GatewayMetrics(registry)
    admission = Admission(config.max_queued)
    orchestrator = Orchestrator(
        config,
        registry,
        create_policy(config.encoder_policy, Role.ENCODER, config.affinity_slack),
        create_policy(config.language_policy, Role.LANGUAGE, config.affinity_slack),
        metrics,
    )
    server = create_server(config.max_queued + 16, config.max_message_mb, "epd-gateway")
    gateway_pb2_grpc.add_GatewayServicer_to_server(
        GatewayServicer(config, admission, orchestrator, registry, metrics), server
    )
    registry_pb2_grpc.add_WorkerRegistryServicer_to_server(
        RegistryServicer(registry, config.heartbeat_interval_s), server
    )
    port, health_servicer = start_server(server, config.host, config.port, SERVICE_NAMES)
    poller = HealthPoller(registry, config.health_poll_s)
    logger.info("gateway serving on %s:%d", config.host, port)
    return GatewayServer(server, port, registry, admission, metrics, poller, health_servicer)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cli_args(parser, GatewayConfig, ENV_PREFIX)


def start(args: argparse.Namespace) -> Running:
    """Serve and expose metrics (``epd serve gateway`` and Ray)."""
    config = from_cli_args(GatewayConfig, args, ENV_PREFIX)
    handle = serve(config)
    metrics_server = None
    if config.metrics_port:
        from common.metrics import start_metrics_server

        metrics_server = start_metrics_server(config.metrics_port, handle.metrics.registry)

    def stop() -> None:
        if metrics_server is not None:
            metrics_server.shutdown()
        handle.stop()

    return Running(handle.port, f"gateway listening on {config.host}:{handle.port}", stop)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return serve_until_terminated(start(args))
