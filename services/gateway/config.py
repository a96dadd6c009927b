"""Gateway configuration: one frozen dataclass, flags and ``EPD_GATEWAY_*`` environment.

Surfaces: the public API on ``host:port`` (TLS and API keys when configured), the worker
registry on ``registry_host:registry_port`` (internal credentials, ``EPD_INTERNAL_*``), and
optionally ``grpc.health.v1`` alone in plaintext on ``health_port`` for probes.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.cli_config import field
from common.internal import InternalConfig
from common.secret_files import read_secret_lines
from common.tls import check_key_pair

ENV_PREFIX = "EPD_GATEWAY_"
POLICIES = ("affinity", "least_load", "round_robin")


@dataclass(frozen=True)
class GatewayConfig:
    host: str = field("127.0.0.1", help="address the gRPC server binds")
    port: int = field(50051, help="gRPC port of the public API (epd.v1.Gateway)")
    # -- surfaces and credentials (docs/security.md) --
    registry_host: str = field("", help="address the worker registry binds ('' = host)")
    registry_port: int = field(
        50052, help="internal gRPC port of the worker registry (workers' --gateway); 0 = free"
    )
    health_port: int = field(
        0, help="plaintext port serving only grpc.health.v1, for probes (0 = off)"
    )
    tls_cert_file: str = field("", help="PEM certificate of the public port ('' = plaintext)")
    tls_key_file: str = field("", help="private key of tls_cert_file")
    api_keys_file: str = field(
        "", help="file of API keys, one per line, re-read on change ('' = none)"
    )
    api_keys: tuple[str, ...] = field(
        (), help="API keys (comma list in the env; prefer the file)", repr=False
    )
    internal: InternalConfig = field(
        InternalConfig(), help="internal gRPC credentials (EPD_INTERNAL_*)"
    )
    # -- end of surfaces and credentials --
    metrics_port: int = field(0, help="Prometheus metrics HTTP port (0 = off)")
    encoders: tuple[str, ...] = field((), help="static encoder addresses host:port")
    languages: tuple[str, ...] = field((), help="static language-worker addresses host:port")
    encoder_policy: str = field("affinity", help="encoder routing: affinity|least_load|round_robin")
    language_policy: str = field(
        "affinity", help="language routing: affinity (cache-aware)|least_load|round_robin"
    )
    affinity_slack: int = field(
        4, help="in-flight requests an affine worker may exceed the least loaded one by"
    )
    heartbeat_interval_s: float = field(1.0, help="how often workers should heartbeat")
    worker_expiry_s: float = field(5.0, help="drop a worker silent for this long")
    health_poll_s: float = field(1.0, help="health/load poll period for every known worker")
    max_queued: int = field(256, help="requests admitted at once; beyond: RESOURCE_EXHAUSTED")
    encoder_retries: int = field(1, help="other encoders tried when one fails before transfer")
    default_timeout_s: float = field(120.0, help="deadline of a request without its own")
    default_max_new_tokens: int = field(128, help="max_new_tokens when the request sets 0")
    max_message_mb: int = field(64, help="largest gRPC message accepted (images are large)")

    def __post_init__(self) -> None:
        self._check_surfaces()
        if self.encoder_policy not in POLICIES or self.language_policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}")
        if self.worker_expiry_s <= self.heartbeat_interval_s:
            raise ValueError("worker_expiry_s must exceed heartbeat_interval_s")
        if self.max_queued < 1 or self.max_message_mb < 1:
            raise ValueError("max_queued and max_message_mb must be positive")
        if not 0 <= self.port < 65536:
            raise ValueError(f"bad port {self.port}")

    @property
    def requires_api_key(self) -> bool:
        return bool(self.api_keys_file or any(k.strip() for k in self.api_keys))

    def _check_surfaces(self) -> None:
        for name in ("port", "registry_port", "health_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} out of range: {getattr(self, name)}")
        busy = [p for p in (self.port, self.registry_port, self.health_port) if p]
        if len(busy) != len(set(busy)):
            raise ValueError(
                f"port, registry_port and health_port must differ, got {self.port}, "
                f"{self.registry_port} and {self.health_port}"
            )
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("public TLS needs both --tls-cert-file and --tls-key-file")
        if self.tls_cert_file:
            check_key_pair(self.tls_cert_file, self.tls_key_file)
        if self.api_keys_file:
            read_secret_lines(self.api_keys_file)
        if self.api_keys and not any(k.strip() for k in self.api_keys):
            raise ValueError("api_keys holds only empty keys")
