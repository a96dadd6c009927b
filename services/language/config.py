"""``LanguageConfig``: every setting of the language service (flags or ``EPD_LANGUAGE_*``)."""

from __future__ import annotations

from dataclasses import dataclass

from common.cli_config import field
from common.transfer.config import TransferConfig
from common.worker import WorkerConfig

ENV_PREFIX = "EPD_LANGUAGE_"


@dataclass(frozen=True)
class LanguageConfig:
    model_path: str = field("", help="Hugging Face Qwen-VL checkpoint directory")
    host: str = field("127.0.0.1", help="gRPC listen address")
    port: int = field(50061, help="gRPC listen port (0 = pick a free one)")
    device: str = field("auto", help="auto | cpu | cuda | cuda:N")
    dtype: str = field("auto", help="auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16")
    kv_cache_memory_mb: int = field(256, help="memory budget of the KV slot pool, MiB")
    num_kv_slots: int = field(0, help="KV token slots; overrides kv_cache_memory_mb when > 0")
    chunk_size: int = field(512, help="most prefill tokens per step (chunked prefill)")
    max_running_requests: int = field(64, help="most requests prefilling or decoding at once")
    max_waiting_requests: int = field(256, help="queued requests beyond this are rejected")
    default_max_new_tokens: int = field(128, help="max_new_tokens when a request sends 0")
    grpc_max_message_mb: int = field(64, help="gRPC max message size, MiB")
    grpc_workers: int = field(32, help="gRPC server threads (one per streaming call)")
    transfer: TransferConfig = field(TransferConfig(), help="the transfer plane (EPD_TRANSFER_*)")
    worker: WorkerConfig = field(WorkerConfig(), help="registration and metrics")

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.max_running_requests < 1:
            raise ValueError("chunk_size and max_running_requests must be >= 1")
        if self.kv_cache_memory_mb < 1 and self.num_kv_slots < 1:
            raise ValueError("set kv_cache_memory_mb or num_kv_slots")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
