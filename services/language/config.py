"""``LanguageConfig``: every setting of the language service (flags or ``EPD_LANGUAGE_*``).

KV pool size, first match wins: ``num_kv_slots`` > 0; ``kv_cache_memory_mb`` > 0; else
``kv_cache_memory_fraction`` of the memory left after the weights and ``kv_cache_reserve_mb``
(see ``kvcache/sizing.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.cli_config import field
from common.compute import check_compute_settings
from common.linear_kernels import LINEAR_KERNELS as COMMON_LINEAR_KERNELS
from common.transfer.config import TransferConfig
from common.worker import WorkerConfig

ENV_PREFIX = "EPD_LANGUAGE_"
PREFILL_ATTENTION = ("auto", "sdpa", "native")
LINEAR_KERNELS = (*COMMON_LINEAR_KERNELS, "native")  # native: the decoder on the native kernels


@dataclass(frozen=True)
class LanguageConfig:
    model_path: str = field("", help="Hugging Face Qwen-VL checkpoint directory")
    host: str = field("127.0.0.1", help="gRPC listen address")
    port: int = field(50061, help="gRPC listen port (0 = pick a free one)")
    device: str = field("auto", help="auto | cpu | cuda | cuda:N")
    dtype: str = field(
        "auto",
        help="compute dtype: auto (bfloat16 on CUDA and on a CPU with native bf16, else "
        "float32) | float32 | bfloat16 | float16",
    )
    linear_kernel: str = field(
        "auto",
        help="kernel of the linear layers: auto (native where it runs, else onednn where it "
        "runs, else plain) | plain (F.linear, the reference) | onednn (weights prepacked once; "
        "CPU fp32 or bf16 only, else it falls back to plain and logs why) | native (bf16 on a "
        "CPU with AVX-512 BF16 and the native cpu_kernels, Qwen2-style layers: the decoder "
        "layers' linears on the LM head's packed blocks and a step's layers in one C call; "
        "an error where it cannot run)",
    )
    cpu_kernels: str = field(
        "auto",
        help="kernels of the RMSNorms, the rotary embedding with its KV write, (GQA groups "
        "of up to 4 query heads, 8 in bf16 on AVX-512 BF16) decode attention and, in bf16 on a "
        "CPU with AVX-512 BF16, the LM head (a step of greedy rows takes each row's maximum "
        "without writing its logits, screened on an int8 copy first where the CPU has AVX-512 "
        "VNNI): "
        "auto (native on a CPU where they build, else torch) | torch (torch's ops, the "
        "reference) | native (C kernels built at first use with the system's C compiler; an "
        "error where they cannot run)",
    )
    prefill_attention: str = field(
        "auto",
        help="kernel of prefill attention: auto (native where it runs, else sdpa) | sdpa "
        "(torch's scaled_dot_product_attention, the reference) | native (a C kernel on AVX-512 "
        "BF16 for bf16 on a CPU, head_dim a multiple of 16 up to 256; ~2.4x SDPA's speed, "
        "as accurate, not bit-equal; an error where it cannot run)",
    )
    kv_cache_memory_fraction: float = field(
        0.9,
        help="share of the device memory left after the weights and kv_cache_reserve_mb that "
        "the KV pool takes (CUDA: free memory; CPU: MemAvailable, capped by the cgroup limit)",
    )
    kv_cache_reserve_mb: int = field(
        1024, help="memory kept out of the KV pool for activations and the rest of the process"
    )
    kv_cache_memory_mb: int = field(
        0, help="KV pool size in MiB; > 0 overrides kv_cache_memory_fraction"
    )
    num_kv_slots: int = field(0, help="KV token slots; > 0 overrides both memory settings")
    max_seq_len: int = field(
        0,
        help="longest prompt + completion of one request (0 = the KV pool's capacity, at most "
        "the model's max_position_embeddings); clamped to the KV pool's capacity",
    )
    chunk_size: int = field(2048, help="most prefill tokens per step (chunked prefill)")
    prefill_while_receiving: bool = field(
        True,
        help="prefill a prompt's first tokens as their chunks land, while the rest is still "
        "encoded or on the wire (off: wait for the whole prompt)",
    )
    partial_prefill_while_decoding: bool = field(
        False,
        help="with prefill_while_receiving, prefill the arrived part of a prompt in any step "
        "(off: it stays out of steps that would otherwise only decode other requests until all "
        "of it, or a whole chunk of it, arrived: each step carrying prefill tokens delays every "
        "decoding stream's next token)",
    )
    max_running_requests: int = field(64, help="most requests prefilling or decoding at once")
    cuda_graphs: bool = field(
        True,
        help="on CUDA, run decode steps as captured CUDA graphs, one per batch and key-length "
        "bucket, captured the first time a step of that shape runs (off: every step eagerly)",
    )
    cuda_graph_max_batch: int = field(
        64, help="largest decode batch a CUDA graph runs (larger batches run eagerly)"
    )
    cuda_graph_max_keys: int = field(
        65536,
        help="most keys a CUDA-graph decode step attends to, padding included (batch bucket x "
        "longest request's KV length rounded up to a power of two); a larger step runs eagerly",
    )
    max_waiting_requests: int = field(256, help="queued requests beyond this are rejected")
    default_max_new_tokens: int = field(
        128, help="max_new_tokens when a request sends 0 (shortened to fit max_seq_len)"
    )
    grpc_max_message_mb: int = field(64, help="gRPC max message size, MiB")
    grpc_workers: int = field(
        256,
        help="concurrent Generate streams (one thread each, asleep while its request waits); "
        "more get RESOURCE_EXHAUSTED and the gateway retries them later (8 more threads serve "
        "health, GetLoad and Abort). Keep it at least max_running_requests: fewer streams cap "
        "the decode batch",
    )
    transfer: TransferConfig = field(TransferConfig(), help="the transfer plane (EPD_TRANSFER_*)")
    worker: WorkerConfig = field(WorkerConfig(), help="registration and metrics")

    def __post_init__(self) -> None:
        check_compute_settings(
            self.device, self.dtype, self.linear_kernel, self.cpu_kernels, LINEAR_KERNELS
        )
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(
                f"prefill_attention must be one of {PREFILL_ATTENTION}, "
                f"got {self.prefill_attention!r}"
            )
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        for name in ("kv_cache_reserve_mb", "kv_cache_memory_mb", "num_kv_slots", "max_seq_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "chunk_size",
            "max_running_requests",
            "cuda_graph_max_batch",
            "cuda_graph_max_keys",
            "max_waiting_requests",
            "default_max_new_tokens",
            "grpc_max_message_mb",
            "grpc_workers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
