"""What every worker process has besides its own service: registration, metrics, credentials,
and the drain.

``WorkerConfig`` is nested in the encoder's and the language worker's configs (same flags, each
under its role's env prefix); it nests the internal credentials (``common.internal``, env
``EPD_INTERNAL_*`` for every role). ``WorkerRuntime`` starts the heartbeats to every gateway's
registry port (``common.registration.Registrar``: carrying what the worker's own ``GetLoad``
reply says and its ``info``: its served model name under ``"model"``, which the gateway's HTTP
API lists in ``/v1/models``; presenting the internal credentials) and the Prometheus endpoint,
and stops both on shutdown.

``drain_worker`` is a worker's answer to SIGTERM, in this order: readiness NOT_SERVING; leave
every gateway (heartbeats stop, ``Deregister``: no new request is routed here); a short settle for
calls already on their way; refuse new work (``UNAVAILABLE``, "draining"); wait for the work in
flight (the server's work calls, then the role's own ``until_idle``) or the deadline.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from common.advertise import advertised_host, transfer_host
from common.channels import Keepalive
from common.cli_config import add_cli_args, field, from_cli_args
from common.grpc_server import Server
from common.internal import (
    InternalConfig,
    add_internal_arguments,
    channel_security,
    internal_config,
)
from common.load_figures import LoadReply
from common.registration import Registrar, parse_gateways
from common.transfer.config import ENV_PREFIX as TRANSFER_ENV_PREFIX
from common.transfer.config import TransferConfig

logger = logging.getLogger(__name__)
# NOTE: a gateway may have routed a request here just before it processed our Deregister; that
# call is on its way. New work is still taken this long after leaving, so it is served, not
# refused (a refused language request would fail, not move on).
DEREGISTER_SETTLE_S = 0.5


@dataclass(frozen=True)
class WorkerConfig:
    gateway: str = field(
        "",
        help="registry addresses host:port of the gateways to register with, comma-separated; "
        "a name stands for every address it resolves to (a headless Service of the gateway "
        "pods), re-resolved every gateway_resolve_interval_s ('' = static list only)",
    )
    gateway_resolve_interval_s: float = field(
        2.0, help="seconds between resolutions of the names in gateway (new gateways, gone ones)"
    )
    drain_timeout_s: float = field(
        50.0,
        help="on SIGTERM, seconds to finish the work in flight after leaving the gateways, then "
        "exit (keep it under the pod's terminationGracePeriodSeconds; 0 = exit at once)",
    )
    advertise_host: str = field(
        "",
        help="address the gateways and the other workers reach this worker at ('' = the bind "
        "host; when that is 0.0.0.0, the address of the interface that routes to the first "
        "gateway); never a loopback address when a gateway is on another host",
    )
    capacity: int = field(64, help="requests this worker takes at once (routing hint)")
    compute_threads: int = field(
        0,
        help="threads the model's operators use (torch intra-op threads; 0 = torch's default, "
        "one per core). Give each process its own cores' worth when several share a machine",
    )
    heartbeat_interval_s: float = field(1.0, help="seconds between heartbeats to the gateway")
    keepalive_s: float = field(
        10.0,
        help="seconds between HTTP/2 pings to each caller (the gateways): a gateway cut off "
        "ends its calls here, freeing their KV slots and rooms, within keepalive_timeout_s "
        "while a stream carries tokens, keepalive_s + keepalive_timeout_s when idle",
    )
    keepalive_timeout_s: float = field(
        5.0, help="seconds a ping may go unanswered (and sent bytes unacknowledged)"
    )
    metrics_port: int = field(0, help="Prometheus metrics HTTP port (0 = off)")
    health_port: int = field(
        0, help="plaintext port serving only grpc.health.v1, for probes (0 = off)"
    )
    served_model_name: str = field(
        "",
        help="the model name the gateway's HTTP API serves this checkpoint as ('' = the "
        "checkpoint directory's name)",
    )
    internal: InternalConfig = field(
        InternalConfig(), help="internal gRPC credentials (EPD_INTERNAL_*)"
    )

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.heartbeat_interval_s <= 0:
            raise ValueError("capacity and heartbeat_interval_s must be positive")
        if self.gateway_resolve_interval_s <= 0:
            raise ValueError(
                "gateway_resolve_interval_s must be positive, got "
                f"{self.gateway_resolve_interval_s}"
            )
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.keepalive_s <= 0 or self.keepalive_timeout_s <= 0:
            raise ValueError("keepalive_s and keepalive_timeout_s must be positive")
        if self.compute_threads < 0:
            raise ValueError(f"compute_threads must be >= 0, got {self.compute_threads}")
        parse_gateways(self.gateway)
        for name in ("metrics_port", "health_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} out of range: {getattr(self, name)}")

    @property
    def keepalive(self) -> Keepalive:
        return Keepalive(self.keepalive_s, self.keepalive_timeout_s)


class WorkerRuntime:
    """Heartbeats + metrics endpoint of one worker; ``leave()`` deregisters from every gateway,
    ``stop()`` does that (if not done) and stops the metrics endpoint."""

    def __init__(
        self,
        config: WorkerConfig,
        role: str,
        bind_host: str,
        port: int,
        report_fn: Callable[[], LoadReply],
        info: dict[str, str] | None = None,
        registry=None,
    ) -> None:
        self.address = f"{config.advertise_host or bind_host}:{port}"
        info = dict(info or {})
        if config.served_model_name:
            info["model"] = config.served_model_name
        self._registrar: Registrar | None = None
        self._metrics = None
        if config.metrics_port and registry is not None:
            from common.metrics import start_metrics_server

            self._metrics = start_metrics_server(config.metrics_port, registry)
        if config.gateway:
            self._registrar = Registrar(
                config.gateway,
                self.address,
                role,
                config.capacity,
                report_fn,
                info,
                config.heartbeat_interval_s,
                security=channel_security(config.internal),
                resolve_interval_s=config.gateway_resolve_interval_s,
            ).start()

    @property
    def gateways(self) -> list[str]:
        """The gateway registries heartbeated now."""
        return self._registrar.targets if self._registrar is not None else []

    def leave(self) -> None:
        """Stop heartbeating and deregister from every gateway (idempotent)."""
        if self._registrar is not None:
            self._registrar.stop()

    def stop(self) -> None:
        self.leave()
        if self._metrics is not None:
            self._metrics.shutdown()


def drain_worker(
    server: Server,
    runtime: WorkerRuntime,
    deadline: float,
    until_idle: Callable[[float], bool] | None = None,
) -> bool:
    """A worker's drain (see the module docstring); True when its work ended before
    ``deadline`` (``time.monotonic``). ``until_idle(deadline)`` waits for the role's work that
    outlives its calls (an encoder's rooms)."""
    start = time.monotonic()
    if server.readiness is not None:
        server.readiness.drain()
    gateways = runtime.gateways
    runtime.leave()
    left_s = time.monotonic() - start
    time.sleep(max(0.0, min(DEREGISTER_SETTLE_S, deadline - time.monotonic())))
    if server.gate is not None:
        server.gate.close()
        logger.info(
            "draining: left %d gateways in %.2f s; %d calls in flight, up to %.0f s",
            len(gateways),
            left_s,
            server.gate.num_in_flight,
            max(0.0, deadline - time.monotonic()),
        )
    idle = server.gate.wait_idle(deadline) if server.gate is not None else True
    if idle and until_idle is not None:
        idle = until_idle(deadline)
    took = time.monotonic() - start
    if idle:
        logger.info("drained in %.1f s", took)
    else:
        calls = server.gate.num_in_flight if server.gate is not None else 0
        logger.warning("drain timeout after %.1f s with %d calls in flight: stopping", took, calls)
    return idle


def add_worker_arguments(parser: argparse.ArgumentParser, env_prefix: str) -> None:
    """Flags of the configs every worker nests: registration/metrics/credentials and the
    transfer plane."""
    add_cli_args(parser, WorkerConfig, env_prefix)
    add_internal_arguments(parser)
    add_cli_args(parser, TransferConfig, TRANSFER_ENV_PREFIX, flag_prefix="transfer")


@dataclass(frozen=True)
class _ServiceFields:
    """The service config's own ``model_path`` and ``host`` fields, read the same way (flag,
    then env)."""

    model_path: str = field("", help="checkpoint directory")
    host: str = field("127.0.0.1", help="address the gRPC server binds")


def served_model_name(model_path: str) -> str:
    """The default served name of a checkpoint: its directory's name."""
    return Path(model_path).name if model_path else ""


def worker_configs(args: argparse.Namespace, env_prefix: str) -> dict:
    """``{"worker": WorkerConfig, "transfer": TransferConfig}`` to nest in a service config.
    The worker's served model name defaults to the checkpoint directory's name; its advertised
    host and its transfer host are decided here, once (``common.advertise``): ValueError when
    peers could not reach them."""
    worker = from_cli_args(WorkerConfig, args, env_prefix, internal=internal_config(args))
    service = from_cli_args(_ServiceFields, args, env_prefix)
    if not worker.served_model_name:
        worker = replace(worker, served_model_name=served_model_name(service.model_path))
    advertised = advertised_host(worker.advertise_host, service.host, worker.gateway)
    transfer = from_cli_args(TransferConfig, args, TRANSFER_ENV_PREFIX, flag_prefix="transfer")
    host = transfer_host(transfer.host, advertised, worker.gateway)
    return {
        "worker": replace(worker, advertise_host=advertised),
        "transfer": replace(transfer, host=host),
    }
