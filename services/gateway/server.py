"""``epd serve gateway``: the public API and the worker registry, each on its own gRPC port,
and optionally the OpenAI-compatible HTTP API with the status page on a port of its own.

The public port serves ``epd.v1.Gateway``, health and reflection, with TLS and API keys when
configured (the HTTP port takes the same files and keys; ``http/``); both front doors share one
``frontdoor.FrontDoor``. ``Generate`` streams beyond the admission bound (``max_queued``) are
refused with ``RESOURCE_EXHAUSTED`` so health always answers. The registry port
(``epd.v1.WorkerRegistry``, its own health and reflection) is internal: workers heartbeat there,
with the internal credentials (``EPD_INTERNAL_*``) that the gateway also presents when it calls
them.

``serve(config)`` starts everything in-process and returns a ``GatewayServer``; a background
thread polls every known worker's health and load and drops self-registered workers that went
silent. A dropped worker's channel closes only once the calls on it ended
(``lingering.LingeringChannel``), so a worker that deregisters to drain finishes its streams.

Readiness (``common.drain.READINESS``) turns SERVING ``ready_delay_s`` after start-up, once the
workers had time to find this gateway. On SIGTERM the gateway drains (``GatewayServer.drain``):
readiness NOT_SERVING, the public port takes no new call (clients get GOAWAY and reconnect to
another gateway; the client with several addresses moves on), the streams in flight run to
their end, up to ``drain_timeout_s``; the registry port serves to the end.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health

from common.allocator import allocator_line
from common.auth import BearerAuthInterceptor, BearerKeys
from common.cli_config import add_cli_args, from_cli_args
from common.grpc_server import (
    Running,
    Server,
    ServerSecurity,
    create_server,
    serve_until_terminated,
    start_server,
)
from common.internal import add_internal_arguments, channel_security, internal_config
from common.internal import server_security as internal_server_security
from common.secret_files import SecretFile
from common.stream_capacity import StreamCapacity
from common.tls import ServerTLS
from protos.epd.v1 import gateway_pb2, gateway_pb2_grpc, registry_pb2, registry_pb2_grpc
from services.gateway import workers as calls
from services.gateway.admission import Admission, queue_full_message
from services.gateway.config import ENV_PREFIX, GatewayConfig
from services.gateway.frontdoor import Api, FrontDoor
from services.gateway.lingering import LingeringChannel
from services.gateway.metrics import GatewayMetrics
from services.gateway.orchestrator import Orchestrator
from services.gateway.registry import Role, WorkerRegistry
from services.gateway.routing import create_policy
from services.gateway.servicer import GatewayServicer, RegistryServicer

if TYPE_CHECKING:
    from services.gateway.http.server import HttpService

logger = logging.getLogger(__name__)
GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
REGISTRY_SERVICE = registry_pb2.DESCRIPTOR.services_by_name["WorkerRegistry"].full_name
LONG_METHODS = (f"/{GATEWAY_SERVICE}/Generate", f"/{GATEWAY_SERVICE}/GenerateUnary")
REGISTRY_THREADS = 8  # the registry's calls are all short: heartbeats, lists


class HealthPoller:
    """Polls each worker's readiness + load every ``period_s``; expires silent workers."""

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
    server: Server
    port: int
    registry: WorkerRegistry
    admission: Admission
    metrics: GatewayMetrics
    poller: HealthPoller
    health: health.HealthServicer
    registry_server: grpc.Server
    registry_port: int
    registry_health: health.HealthServicer
    http: HttpService | None = None  # the HTTP front door, when http_port is set
    ready_timer: threading.Timer | None = None

    @property
    def http_port(self) -> int:
        return self.http.server.port if self.http is not None else 0

    def drain(self, deadline: float) -> bool:
        """Take no new request on either front door and wait for the requests in flight until
        ``deadline`` (``time.monotonic``); True when they all ended."""
        start = time.monotonic()
        if self.ready_timer is not None:
            self.ready_timer.cancel()
        self.server.readiness.drain()
        num_streams = self.admission.num_in_flight
        done = self.server.stop_accepting(max(0.0, deadline - start))
        http_stop = None
        if self.http is not None:  # stops listening, lets its requests finish up to the deadline
            http_stop = threading.Thread(
                target=self.http.stop, args=(max(0.0, deadline - start),), name="http-drain"
            )
            http_stop.start()
        logger.info("draining: %d requests in flight, up to %.0f s", num_streams, deadline - start)
        drained = done.wait(max(0.0, deadline - time.monotonic()))
        if http_stop is not None:
            http_stop.join(max(0.0, deadline - time.monotonic()))
            drained = drained and not http_stop.is_alive()
        took = time.monotonic() - start
        if drained:
            logger.info("drained in %.1f s", took)
        else:
            left = self.admission.num_in_flight
            logger.warning("drain timeout after %.1f s with %d requests in flight", took, left)
        return drained

    def stop(self, grace_s: float = 2.0) -> None:
        if self.ready_timer is not None:
            self.ready_timer.cancel()
        self.health.enter_graceful_shutdown()
        self.registry_health.enter_graceful_shutdown()
        if self.http is not None:
            self.http.stop(grace_s)
        self.poller.stop()
        self.server.stop(grace_s).wait()
        self.registry_server.stop(grace_s).wait()
        self.registry.close()


def api_keys(config: GatewayConfig) -> BearerKeys | None:
    """The API keys of the public port and the HTTP port (None: no key needed)."""
    if not config.requires_api_key:
        return None
    keys_file = SecretFile(config.api_keys_file) if config.api_keys_file else None
    return BearerKeys(config.api_keys, keys_file)


def public_security(
    config: GatewayConfig, metrics: GatewayMetrics | None = None, keys: BearerKeys | None = None
) -> ServerSecurity | None:
    """TLS and/or API keys (``keys``, else read from ``config``) on the public port, as
    configured (None: plaintext, open). Requests refused for want of a key count under
    ``UNAUTHENTICATED`` in ``metrics``."""
    tls = ServerTLS(config.tls_cert_file, config.tls_key_file) if config.tls_cert_file else None
    auth = None
    keys = keys or api_keys(config)
    if keys is not None:

        def count(method: str) -> None:
            if metrics is not None and method in LONG_METHODS:
                metrics.finished("UNAUTHENTICATED", Api.GRPC.value)

        auth = BearerAuthInterceptor(keys, "API key", on_refuse=count)
    return ServerSecurity(tls=tls, auth=auth) if tls or auth else None


def _start_registry(
    config: GatewayConfig, registry: WorkerRegistry
) -> tuple[Server, int, health.HealthServicer]:
    server = create_server(
        "epd-registry",
        config.max_message_mb,
        StreamCapacity(0, reserve=REGISTRY_THREADS, who="gateway registry"),
        internal_server_security(config.internal),
        keepalive=config.keepalive,
    )
    registry_pb2_grpc.add_WorkerRegistryServicer_to_server(
        RegistryServicer(registry, config.heartbeat_interval_s), server
    )
    host = config.registry_host or config.host
    port, health_servicer = start_server(server, host, config.registry_port, (REGISTRY_SERVICE,))
    return server, port, health_servicer


def serve(config: GatewayConfig) -> GatewayServer:
    worker_security = channel_security(config.internal)
    registry = WorkerRegistry(
        config.worker_expiry_s,
        lambda address: LingeringChannel(
            calls.create_channel(address, config.max_message_mb, worker_security, config.keepalive)
        ),
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
    front_door = FrontDoor(config, admission, orchestrator, metrics)
    # The admission bound is the stream bound: the same refusal, whichever sees it first.
    capacity = StreamCapacity(
        config.max_queued,
        LONG_METHODS,
        who="gateway",
        on_reject=lambda _method: metrics.finished("RESOURCE_EXHAUSTED", Api.GRPC.value),
        message=queue_full_message(config.max_queued),
    )
    keys = api_keys(config)
    security = public_security(config, metrics, keys)
    http = None
    if config.http_port:  # first: it serves before gRPC health says SERVING
        from services.gateway.http.server import start_http  # FastAPI only when asked for

        tls = security.tls if security is not None else None
        http = start_http(config, front_door, registry, keys, tls)
    started: list = []
    try:
        server = create_server(
            "epd-gateway", config.max_message_mb, capacity, security, keepalive=config.keepalive
        )
        gateway_pb2_grpc.add_GatewayServicer_to_server(
            GatewayServicer(config, front_door, registry), server
        )
        port, health_servicer = start_server(
            server,
            config.host,
            config.port,
            (GATEWAY_SERVICE,),
            health_port=config.health_port,
            ready=config.ready_delay_s <= 0,
        )
        started.append(server)
        if http is not None:
            http.context.readiness = server.readiness
        registry_server, registry_port, registry_health = _start_registry(config, registry)
    except BaseException:
        for running in started:
            running.stop(None)
        if http is not None:
            http.stop(0)
        raise
    poller = HealthPoller(registry, config.health_poll_s)
    ready_timer = None
    if config.ready_delay_s > 0:
        ready_timer = threading.Timer(config.ready_delay_s, server.readiness.set, (True,))
        ready_timer.daemon = True
        ready_timer.start()
    logger.info(allocator_line())
    logger.info(
        "gateway public API on %s:%d (%s), worker registry on %s:%d (%s)%s",
        config.host,
        port,
        server.security.describe,
        config.registry_host or config.host,
        registry_port,
        registry_server.security.describe,
        f", HTTP API on {http.server.url}" if http is not None else "",
    )
    return GatewayServer(
        server,
        port,
        registry,
        admission,
        metrics,
        poller,
        health_servicer,
        registry_server,
        registry_port,
        registry_health,
        http,
        ready_timer,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cli_args(parser, GatewayConfig, ENV_PREFIX)
    add_internal_arguments(parser)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return from_cli_args(GatewayConfig, args, ENV_PREFIX, internal=internal_config(args))


def start(args: argparse.Namespace) -> Running:
    """Serve and expose metrics (``epd serve gateway`` and Ray)."""
    config = config_from_args(args)
    handle = serve(config)
    metrics_server = None
    if config.metrics_port:
        from common.metrics import start_metrics_server

        metrics_server = start_metrics_server(config.metrics_port, handle.metrics.registry)

    def stop() -> None:
        if metrics_server is not None:
            metrics_server.shutdown()
        handle.stop()

    registry_host = config.registry_host or config.host
    banner = (
        f"gateway listening on {config.host}:{handle.port} "
        f"(worker registry on {registry_host}:{handle.registry_port})"
    )
    if handle.http is not None:
        banner += f"; HTTP API on {handle.http.server.url}"
    return Running(
        handle.port,
        banner,
        stop,
        registry_port=handle.registry_port,
        drain=handle.drain,
        drain_timeout_s=config.drain_timeout_s,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return serve_until_terminated(lambda: start(args))
