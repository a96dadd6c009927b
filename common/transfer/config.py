"""Configuration of the embedding transfer plane (both the sender and the receiver side).

The control secret is given as a file path (``secret_file``), never as a value: it comes from
a mounted Kubernetes Secret and stays off command lines and out of the environment.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.cli_config import field

from .auth import load_secret

ENV_PREFIX = "EPD_TRANSFER_"
TRANSPORTS = ("mooncake", "shm", "auto")
WIRE_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class TransferConfig:
    """Settings of one transfer endpoint; flags ``--block-size`` etc., env ``EPD_TRANSFER_*``."""

    dtype: str = field(
        "bfloat16",
        help="wire dtype of image rows (bfloat16 | float16 | float32), the same on every encoder "
        "and language worker; each side casts from/to its own compute dtype",
    )
    block_size: int = field(128, help="tokens per buffer block")
    num_blocks: int = field(512, help="blocks in the buffer (token slots = num_blocks*block_size)")
    default_tokens: int = field(
        1024, help="receiver's first preallocation per room (a multiple of block_size)"
    )
    transport: str = field(
        "auto", help="mooncake | shm | auto (shm only when both ends share a host)"
    )
    protocol: str = field("tcp", help="Mooncake protocol: tcp here, rdma in production")
    device_names: str = field("", help="RDMA device names, e.g. mlx5_0,mlx5_1")
    host: str = field(
        "",
        help="address the control socket and Mooncake bind and advertise to peers ('' = a "
        "worker's advertised host; 127.0.0.1 for a bare endpoint)",
    )
    control_port: int = field(0, help="ZMQ control port; 0 picks a free port")
    bootstrap_timeout_s: float = field(
        30.0,
        help="a room the encoder did not announce (no expect() with the request's deadline): "
        "its data waiting for an init, or an init waiting for its data; an announced room that "
        "no receiver asked for or claimed (its gateway died first)",
    )
    waiting_timeout_s: float = field(
        30.0,
        help="without a request deadline: sender waiting for a continuation init, receiver "
        "waiting for free blocks",
    )
    transfer_timeout_s: float = field(30.0, help="a write that does not finish")
    heartbeat_interval_s: float = field(1.0, help="seconds between heartbeats to each peer")
    heartbeat_timeout_s: float = field(5.0, help="a peer silent this long fails its rooms")
    max_room_tokens: int = field(
        262144,
        help="longest request (tokens) a receiver accepts; a sender announcing a longer one "
        "fails the room (set it to the language model's longest sequence)",
    )
    num_writers: int = field(4, help="sender threads issuing writes (a slow peer blocks one)")
    secret_file: str = field(
        "",
        help="file holding the secret that authenticates control frames (HMAC-SHA256, at least "
        "16 bytes; e.g. a mounted Kubernetes Secret), the same on every encoder and language "
        "worker; empty: frames are not authenticated (development only)",
    )
    auth_window_s: float = field(
        10.0,
        help="authenticated frames stamped further than this from our wall clock are dropped "
        "(replay guard; allow for clock skew between hosts)",
    )
    max_peers: int = field(256, help="control sockets kept open to peers (least recent closed)")
    peer_idle_s: float = field(60.0, help="a control socket unused this long is closed")
    max_lent_fraction: float = field(
        0.5,
        help="share of the receive buffer that delivered rooms may keep lent to their consumer "
        "(zero-copy) until released; other rooms are copied out (0 always copies)",
    )

    def __post_init__(self) -> None:
        if self.dtype not in WIRE_DTYPES:
            raise ValueError(f"dtype must be one of {WIRE_DTYPES}, got {self.dtype!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.default_tokens <= 0 or self.default_tokens % self.block_size:
            raise ValueError(
                f"default_tokens ({self.default_tokens}) must be a positive multiple of "
                f"block_size ({self.block_size})"
            )
        if self.default_tokens > self.num_blocks * self.block_size:
            raise ValueError(
                f"default_tokens ({self.default_tokens}) exceeds the buffer "
                f"({self.num_blocks} blocks x {self.block_size} tokens)"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be tcp or rdma, got {self.protocol!r}")
        if not 0 <= self.control_port < 65536:
            raise ValueError(f"control_port out of range: {self.control_port}")
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s")
        if self.max_room_tokens <= 0:
            raise ValueError(f"max_room_tokens must be positive, got {self.max_room_tokens}")
        if self.num_writers <= 0:
            raise ValueError("num_writers must be positive")
        if self.secret_file:
            load_secret(self.secret_file)  # a missing, short or unreadable file fails at start
        if self.auth_window_s <= 0:
            raise ValueError(f"auth_window_s must be positive, got {self.auth_window_s}")
        if self.max_peers <= 0:
            raise ValueError(f"max_peers must be positive, got {self.max_peers}")
        if self.peer_idle_s <= 0:
            raise ValueError(f"peer_idle_s must be positive, got {self.peer_idle_s}")
        if not 0.0 <= self.max_lent_fraction <= 1.0:
            raise ValueError(f"max_lent_fraction must be in [0, 1], got {self.max_lent_fraction}")

    @property
    def bind_host(self) -> str:
        """The host the endpoint binds and advertises (``host``, or 127.0.0.1 when unset)."""
        return self.host or "127.0.0.1"

    @property
    def default_blocks(self) -> int:
        return self.default_tokens // self.block_size

    @property
    def quarantine_s(self) -> float:
        """How long a destination allocation stays reserved after a write may have started."""
        return self.transfer_timeout_s + 2 * self.heartbeat_interval_s
