"""Gateway configuration: one frozen dataclass, flags and ``EPD_GATEWAY_*`` environment.

Surfaces: the public API on ``host:port`` (TLS and API keys when configured), the worker
registry on ``registry_host:registry_port`` (internal credentials, ``EPD_INTERNAL_*``),
optionally ``grpc.health.v1`` alone in plaintext on ``health_port`` for probes, and optionally
the OpenAI-compatible HTTP API with the status page on ``http_host:http_port`` (the public
port's TLS files and API keys).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.channels import Keepalive
from common.cli_config import field
from common.internal import InternalConfig
from common.secret_files import read_secret_lines
from common.tls import check_key_pair

ENV_PREFIX = "EPD_GATEWAY_"
POLICIES = ("affinity", "least_load", "round_robin")
# The request-limit block of GatewayConfig (mirrored by validation.RequestLimits).
REQUEST_LIMIT_FIELDS = (
    "max_messages",
    "max_parts_per_message",
    "max_text_chars",
    "max_images",
    "max_image_bytes",
    "max_image_ref_chars",
    "max_videos",
    "max_video_bytes",
    "max_stop",
    "max_stop_chars",
    "max_stop_token_ids",
    "max_top_k",
    "max_new_tokens_limit",
    "max_request_id_chars",
)


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
    # -- HTTP front door: the OpenAI-compatible API and the status page (services/gateway/http)
    http_port: int = field(
        0, help="port of the OpenAI-compatible HTTP API and /dashboard (0 = off)"
    )
    http_host: str = field("", help="address the HTTP server binds ('' = host)")
    served_model_name: str = field(
        "", help="the model name of /v1/models ('' = the names the language workers report)"
    )
    dashboard: bool = field(True, help="serve the status page /dashboard on the HTTP port")
    dashboard_show_addresses: bool = field(
        False,
        help="show worker addresses on /dashboard to callers without an API key (only when no "
        "API keys are configured; a valid key always shows them)",
    )
    dashboard_sample_s: float = field(2.0, help="seconds between the status page's samples")
    dashboard_history_s: float = field(600.0, help="seconds of samples the status page keeps")
    # -- end of HTTP front door --
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
    health_poll_s: float = field(1.0, help="readiness/load poll period for every known worker")
    keepalive_s: float = field(
        10.0,
        help="seconds between HTTP/2 pings on the gateway's connections (to workers, and to "
        "its own callers): a worker or client cut off ends the calls to it within "
        "keepalive_timeout_s while a stream carries data, keepalive_s + keepalive_timeout_s "
        "when idle (a silent worker's calls end sooner: when worker_expiry_s drops it)",
    )
    keepalive_timeout_s: float = field(
        5.0, help="seconds a ping may go unanswered (and sent bytes unacknowledged)"
    )
    # -- lifecycle (drain on SIGTERM, readiness at start-up) --
    drain_timeout_s: float = field(
        50.0,
        help="on SIGTERM, seconds to finish the streams in flight once no new request is taken, "
        "then exit (keep it under the pod's terminationGracePeriodSeconds; 0 = exit at once)",
    )
    ready_delay_s: float = field(
        3.0,
        help="seconds after start-up before readiness turns SERVING, so that workers finding "
        "gateways by DNS register first (their resolve interval plus a heartbeat)",
    )
    # -- end of lifecycle --
    max_queued: int = field(256, help="requests admitted at once; beyond: RESOURCE_EXHAUSTED")
    encoder_retries: int = field(1, help="other encoders tried when one fails before transfer")
    language_retries: int = field(
        1,
        help="other language workers tried when one is unreachable before it streamed anything "
        "(it is also marked unhealthy at once, until its next good health check)",
    )
    encoder_busy_wait_s: float = field(
        30.0,
        help="when every encoder tried is busy (RESOURCE_EXHAUSTED: stream capacity or queue "
        "full), seconds a request waits and tries again (backing off, within its deadline) "
        "before the refusal reaches the client; 0 = refuse at once",
    )
    language_busy_wait_s: float = field(
        30.0,
        help="when the language workers tried are busy (RESOURCE_EXHAUSTED: at their stream "
        "capacity or queue full), seconds a request waits and tries again (backing off, "
        "within its deadline) before the refusal reaches the client; 0 = refuse at once",
    )
    language_sessions: bool = field(
        True,
        help="send requests to each language worker over one session stream, which carries "
        "one message per engine step for all of them, instead of a stream per request (one "
        "message per token per request); off: a Generate stream per request",
    )
    default_timeout_s: float = field(120.0, help="deadline of a request without its own")
    default_max_new_tokens: int = field(128, help="max_new_tokens when the request sets 0")
    max_message_mb: int = field(64, help="largest gRPC message accepted (images are large)")
    # ---- request limits: every request is checked against them before admission
    # (services/gateway/validation.py); a request past one is INVALID_ARGUMENT naming the field.
    max_messages: int = field(256, help="most chat messages in one request")
    max_parts_per_message: int = field(
        64, help="most content parts (text, image, video) per message"
    )
    max_text_chars: int = field(1 << 20, help="most text characters over all messages of a request")
    max_images: int = field(16, help="most images in one request")
    max_image_bytes: int = field(
        20 << 20,
        help="largest image as raw bytes (`data`); base64 text may be its base64 length plus a "
        "data-URL prefix",
    )
    max_image_ref_chars: int = field(
        8192, help="longest image or video `path` or `url`, in characters"
    )
    max_videos: int = field(2, help="most videos in one request")
    max_video_bytes: int = field(
        64 << 20,
        help="largest video as raw bytes (`data`); base64 text may be its base64 length plus a "
        "data-URL prefix (max_message_mb bounds both)",
    )
    max_stop: int = field(16, help="most stop strings in a request")
    max_stop_chars: int = field(256, help="longest stop string, in characters")
    max_stop_token_ids: int = field(64, help="most stop token ids in a request")
    max_top_k: int = field(262144, help="largest top_k (at least the largest vocabulary)")
    max_new_tokens_limit: int = field(32768, help="largest max_new_tokens a request may ask for")
    max_request_id_chars: int = field(256, help="longest client request_id, in characters")

    def __post_init__(self) -> None:
        self._check_surfaces()
        if self.encoder_policy not in POLICIES or self.language_policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}")
        if self.keepalive_s <= 0 or self.keepalive_timeout_s <= 0:
            raise ValueError("keepalive_s and keepalive_timeout_s must be positive")
        if self.worker_expiry_s <= self.heartbeat_interval_s:
            raise ValueError("worker_expiry_s must exceed heartbeat_interval_s")
        for name in (
            "drain_timeout_s",
            "ready_delay_s",
            "encoder_busy_wait_s",
            "language_busy_wait_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_queued < 1 or self.max_message_mb < 1:
            raise ValueError("max_queued and max_message_mb must be positive")
        if not 0 <= self.port < 65536:
            raise ValueError(f"bad port {self.port}")
        for name in REQUEST_LIMIT_FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens_limit:
            raise ValueError(
                f"default_max_new_tokens ({self.default_max_new_tokens}) must be in "
                f"[1, max_new_tokens_limit ({self.max_new_tokens_limit})]"
            )

    @property
    def keepalive(self) -> Keepalive:
        return Keepalive(self.keepalive_s, self.keepalive_timeout_s)

    @property
    def requires_api_key(self) -> bool:
        return bool(self.api_keys_file or any(k.strip() for k in self.api_keys))

    def _check_surfaces(self) -> None:
        names = ("port", "registry_port", "health_port", "http_port")
        for name in names:
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} out of range: {getattr(self, name)}")
        busy = [getattr(self, name) for name in names if getattr(self, name)]
        if len(busy) != len(set(busy)):
            values = [str(getattr(self, name)) for name in names]
            raise ValueError(
                f"{', '.join(names[:-1])} and {names[-1]} must differ, got "
                f"{', '.join(values[:-1])} and {values[-1]}"
            )
        if not 0 < self.dashboard_sample_s <= self.dashboard_history_s:
            raise ValueError(
                f"dashboard_sample_s ({self.dashboard_sample_s}) must be positive and at most "
                f"dashboard_history_s ({self.dashboard_history_s})"
            )
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("public TLS needs both --tls-cert-file and --tls-key-file")
        if self.tls_cert_file:
            check_key_pair(self.tls_cert_file, self.tls_key_file)
        if self.api_keys_file:
            read_secret_lines(self.api_keys_file)
        if self.api_keys and not any(k.strip() for k in self.api_keys):
            raise ValueError("api_keys holds only empty keys")
