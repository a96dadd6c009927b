"""What every worker process has besides its own service: registration, metrics, credentials.

``WorkerConfig`` is nested in the encoder's and the language worker's configs (same flags, each
under its role's env prefix); it nests the internal credentials (``common.internal``, env
``EPD_INTERNAL_*`` for every role). ``WorkerRuntime`` starts the heartbeat to the gateway's
registry port (carrying what the worker's own ``GetLoad`` reply says and its ``info``: its
served model name under ``"model"``, which the gateway's HTTP API lists in ``/v1/models``;
presenting the internal credentials) and the Prometheus endpoint, and stops both on shutdown.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from common.cli_config import add_cli_args, field, from_cli_args
from common.internal import (
    InternalConfig,
    add_internal_arguments,
    channel_security,
    internal_config,
)
from common.load_figures import LoadReply
from common.registration import Registrar
from common.transfer.config import ENV_PREFIX as TRANSFER_ENV_PREFIX
from common.transfer.config import TransferConfig


@dataclass(frozen=True)
class WorkerConfig:
    gateway: str = field(
        "", help="the gateway's registry address host:port to register with ('' = static list only)"
    )
    advertise_host: str = field(
        "", help="address the gateway reaches this worker at ('' = the bind host)"
    )
    capacity: int = field(64, help="requests this worker takes at once (routing hint)")
    heartbeat_interval_s: float = field(1.0, help="seconds between heartbeats to the gateway")
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
        for name in ("metrics_port", "health_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} out of range: {getattr(self, name)}")


class WorkerRuntime:
    """Heartbeat + metrics endpoint of one worker; ``stop()`` deregisters first."""

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
            ).start()

    def stop(self) -> None:
        if self._registrar is not None:
            self._registrar.stop()
        if self._metrics is not None:
            self._metrics.shutdown()


def add_worker_arguments(parser: argparse.ArgumentParser, env_prefix: str) -> None:
    """Flags of the configs every worker nests: registration/metrics/credentials and the
    transfer plane."""
    add_cli_args(parser, WorkerConfig, env_prefix)
    add_internal_arguments(parser)
    add_cli_args(parser, TransferConfig, TRANSFER_ENV_PREFIX, flag_prefix="transfer")


@dataclass(frozen=True)
class _Checkpoint:
    """The service config's own ``model_path`` field, read the same way (flag, then env)."""

    model_path: str = field("", help="checkpoint directory")


def served_model_name(model_path: str) -> str:
    """The default served name of a checkpoint: its directory's name."""
    return Path(model_path).name if model_path else ""


def worker_configs(args: argparse.Namespace, env_prefix: str) -> dict:
    """``{"worker": WorkerConfig, "transfer": TransferConfig}`` to nest in a service config.
    The worker's served model name defaults to the checkpoint directory's name."""
    worker = from_cli_args(WorkerConfig, args, env_prefix, internal=internal_config(args))
    if not worker.served_model_name:
        checkpoint = from_cli_args(_Checkpoint, args, env_prefix)
        worker = replace(worker, served_model_name=served_model_name(checkpoint.model_path))
    return {
        "worker": worker,
        "transfer": from_cli_args(
            TransferConfig, args, TRANSFER_ENV_PREFIX, flag_prefix="transfer"
        ),
    }
