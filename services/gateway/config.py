"""Gateway configuration: one frozen dataclass, flags and ``EPD_GATEWAY_*`` environment."""

from __future__ import annotations

from dataclasses import dataclass

from common.cli_config import field

ENV_PREFIX = "EPD_GATEWAY_"
POLICIES = ("affinity", "least_load", "round_robin")


@dataclass(frozen=True)
class GatewayConfig:
    host: str = field("127.0.0.1", help="address the gRPC server binds")
    port: int = field(50051, help="gRPC port of the public API and the worker registry")
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
        if self.encoder_policy not in POLICIES or self.language_policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}")
        if self.worker_expiry_s <= self.heartbeat_interval_s:
            raise ValueError("worker_expiry_s must exceed heartbeat_interval_s")
        if self.max_queued < 1 or self.max_message_mb < 1:
            raise ValueError("max_queued and max_message_mb must be positive")
        if not 0 <= self.port < 65536:
            raise ValueError(f"bad port {self.port}")
