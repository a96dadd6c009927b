"""Settings of the encoder service: one frozen dataclass, flags ``--x-y`` / env ``EPD_ENCODER_X_Y``.

The transfer plane keeps its own ``TransferConfig`` (env ``EPD_TRANSFER_*``), nested here.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.cli_config import field
from common.compute import check_compute_settings
from common.transfer.config import TransferConfig
from common.transfer.types import MAX_EXTRA_BYTES
from common.worker import WorkerConfig

from .aux_extra import extra_size_bound, max_images_that_fit

ENV_PREFIX = "EPD_ENCODER_"
VISION_ATTENTIONS = ("auto", "grouped", "per_piece", "native")
SENDERS = ("transfer", "none")


@dataclass(frozen=True)
class EncoderConfig:
    """Everything the encoder process needs besides the checkpoint path."""

    host: str = field("127.0.0.1", help="address the gRPC server binds")
    port: int = field(0, help="gRPC port; 0 picks a free port")
    grpc_workers: int = field(
        64,
        help="concurrent Encode/WaitEncoded calls (image decoding runs on them); more get "
        "RESOURCE_EXHAUSTED and the gateway retries them later (8 more threads serve health, "
        "GetLoad and Cancel)",
    )
    max_message_mb: int = field(64, help="max gRPC receive message size in MiB")
    device: str = field("auto", help="auto (cuda when present, else cpu) | cpu | cuda | cuda:N")
    dtype: str = field(
        "auto",
        help="compute dtype of the vision tower: auto (bfloat16 on CUDA and on a CPU with "
        "native bf16, else float32) | float32 | bfloat16 | float16; rows are cast once to the "
        "transfer dtype after the ViT",
    )
    linear_kernel: str = field(
        "auto",
        help="kernel of the vision tower's linear layers: auto (onednn where it runs, else "
        "plain) | plain (F.linear, the reference) | onednn (weights prepacked once; CPU fp32 or "
        "bf16 only, else it falls back to plain and logs why)",
    )
    cpu_kernels: str = field(
        "auto",
        help="kernels of the vision tower's RMSNorms and rotary embedding and of patch "
        "cutting: auto (native on a CPU where they build, else torch) | torch (torch's "
        "ops, the reference) | native (fused C kernels built at first use with the system's C "
        "compiler; an error where they cannot run)",
    )
    vision_attention: str = field(
        "auto",
        help="how the vision tower attends within each image (and window): auto (native where "
        "it runs, else grouped) | grouped (our forward: equal-length pieces of a batch in one "
        "SDPA call each, rotary in a few passes; the same arithmetic as transformers) | "
        "per_piece (transformers' own forward, one SDPA call per piece) | native (the grouped "
        "forward with every piece in one C kernel call per layer: bf16 on a CPU with AVX-512 "
        "BF16, head_dim a multiple of 16; as accurate as SDPA, not bit-equal; an error where it "
        "cannot run)",
    )
    # intake
    max_image_bytes: int = field(20 << 20, help="largest encoded image accepted, in bytes")
    max_image_pixels: int = field(
        64_000_000, help="largest decoded image (width*height) accepted: decompression bombs"
    )
    min_image_side: int = field(2, help="smallest accepted image width or height, in pixels")
    max_aspect_ratio: float = field(200.0, help="largest accepted long side / short side")
    max_images: int = field(
        16,
        help="most images and videos together in one request (at most what one transfer aux "
        "record describes: 23 with the default max_prompt_tokens)",
    )
    max_prompt_tokens: int = field(32768, help="longest prompt after image expansion, in tokens")
    allowed_dirs: tuple[str, ...] = field(
        (), help="directories local image and video paths may lie under"
    )
    allow_urls: bool = field(False, help="fetch http(s) image and video URLs")
    allow_private_urls: bool = field(
        False, help="allow URLs resolving to private/loopback/link-local addresses"
    )
    url_timeout_s: float = field(10.0, help="timeout of one image download")
    # video intake (checked from the container's header and packets before decoding)
    max_videos: int = field(
        2, help="most videos in one request (each also counts against max_images); 0 refuses them"
    )
    max_video_bytes: int = field(64 << 20, help="largest encoded video accepted, in bytes")
    max_video_seconds: float = field(600.0, help="longest video accepted, in seconds")
    max_video_source_frames: int = field(
        36_000, help="most frames a video file may hold (all of them, not only sampled ones)"
    )
    max_video_frame_pixels: int = field(
        8_294_400, help="largest video frame (width*height) accepted (default: 4K UHD)"
    )
    max_video_streams: int = field(8, help="most streams (video, audio, ...) in a container")
    # video sampling defaults and bounds (a request may ask for less, never more)
    video_fps: float = field(2.0, help="frames sampled per second of video (Qwen's default)")
    video_min_frames: int = field(4, help="fewest frames sampled (as the video has them)")
    video_max_frames: int = field(
        768, help="most frames sampled from one video (rounded down to a multiple of 2)"
    )
    video_min_pixels: int = field(
        0, help="per-frame smart_resize lower bound in pixels; 0 = 128 merged patches"
    )
    video_max_pixels: int = field(
        0, help="per-frame smart_resize upper bound in pixels; 0 = 768 merged patches"
    )
    video_total_pixels: int = field(
        0,
        help="pixels of all sampled frames of one video together (each frame gets its share, "
        "never below 1.05 x video_min_pixels); 0 = 90% of the request's prompt limit's worth "
        "(max_prompt_tokens, or the language worker's lower limit the gateway sends)",
    )
    # preprocessing
    min_pixels: int = field(0, help="smart_resize lower bound in pixels; 0 = the checkpoint's")
    max_pixels: int = field(0, help="smart_resize upper bound in pixels; 0 = the checkpoint's")
    # ViT execution
    max_batch_patches: int = field(
        16384, help="patch budget of one ViT forward (an image larger than it runs alone)"
    )
    max_batch_ms: float = field(
        200.0,
        help="time target of one ViT forward on a CPU: images join a batch while the last "
        "forwards' time per patch says it ends within this many ms (the first always fits); "
        "where one image fills the cores a bigger batch only makes its requests wait for each "
        "other. On a GPU, where batching pays, and at 0: the patch budget alone",
    )
    max_queued_requests: int = field(64, help="requests queued or encoding; more are refused")
    max_queued_pixel_mb: int = field(
        1024,
        help="MiB of image patches (in the tower's dtype: ~19 KB per image token in fp32, half "
        "in bf16) queued requests may hold; a request that would exceed it is refused with "
        "RESOURCE_EXHAUSTED unless none are held",
    )
    cache_mb: int = field(512, help="embedding cache size in MiB; 0 disables it")
    ship_per_image: bool = field(
        True,
        help="ship a request's rows image by image as the ViT finishes each (the language "
        "worker prefills the first images meanwhile); off: once all are encoded",
    )
    # shipping
    sender: str = field("transfer", help="transfer (ship to the language side) | none")
    submit_retry_s: float = field(0.005, help="retry interval when the sender is short of blocks")
    default_timeout_s: float = field(
        120.0,
        help="deadline of a room whose Encode carries no timeout_s, in seconds from its arrival "
        "(a room waits for the ViT and for transfer blocks until then, not longer)",
    )
    result_ttl_s: float = field(300.0, help="how long a finished room's outcome stays queryable")
    transfer: TransferConfig = field(TransferConfig(), help="the transfer plane (EPD_TRANSFER_*)")
    worker: WorkerConfig = field(WorkerConfig(), help="registration and metrics")

    def __post_init__(self) -> None:
        positive = (
            "grpc_workers",
            "max_message_mb",
            "max_image_bytes",
            "max_image_pixels",
            "min_image_side",
            "max_images",
            "max_prompt_tokens",
            "max_batch_patches",
            "max_queued_requests",
            "max_queued_pixel_mb",
            "max_video_bytes",
            "max_video_source_frames",
            "max_video_frame_pixels",
            "max_video_streams",
            "video_min_frames",
            "video_max_frames",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("url_timeout_s", "submit_retry_s", "default_timeout_s", "result_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_videos < 0:
            raise ValueError(f"max_videos must be >= 0, got {self.max_videos}")
        for name in ("max_video_seconds", "video_fps"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)}")
        if self.video_min_frames > self.video_max_frames:
            raise ValueError(
                f"video_min_frames ({self.video_min_frames}) > video_max_frames "
                f"({self.video_max_frames})"
            )
        for name in ("video_min_pixels", "video_max_pixels", "video_total_pixels"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.video_min_pixels and self.video_max_pixels:
            if self.video_min_pixels > self.video_max_pixels:
                raise ValueError(
                    f"video_min_pixels ({self.video_min_pixels}) > video_max_pixels "
                    f"({self.video_max_pixels})"
                )
        if self.max_aspect_ratio < 1:
            raise ValueError(f"max_aspect_ratio must be >= 1, got {self.max_aspect_ratio}")
        if self.min_pixels < 0 or self.max_pixels < 0:
            raise ValueError("min_pixels and max_pixels must be >= 0")
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) > max_pixels ({self.max_pixels})")
        if self.cache_mb < 0:
            raise ValueError(f"cache_mb must be >= 0, got {self.cache_mb}")
        if not 0 <= self.max_batch_ms < float("inf"):
            raise ValueError(f"max_batch_ms must be >= 0, got {self.max_batch_ms}")
        check_compute_settings(self.device, self.dtype, self.linear_kernel, self.cpu_kernels)
        if self.vision_attention not in VISION_ATTENTIONS:
            raise ValueError(
                f"vision_attention must be one of {VISION_ATTENTIONS}, "
                f"got {self.vision_attention!r}"
            )
        if self.sender not in SENDERS:
            raise ValueError(f"sender must be one of {SENDERS}, got {self.sender!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        fit = max_images_that_fit(self.max_prompt_tokens)
        if self.max_images > fit:
            raise ValueError(
                f"max_images ({self.max_images}) is more than a transfer aux record can describe: "
                f"the hashes and token counts of {self.max_images} images need up to "
                f"{extra_size_bound(self.max_images, self.max_prompt_tokens)} bytes, it holds "
                f"{MAX_EXTRA_BYTES}; at most {fit} images fit (with max_prompt_tokens "
                f"{self.max_prompt_tokens})"
            )

    @property
    def prompt_token_limit(self) -> int:
        """The longest prompt accepted: ``max_prompt_tokens``, and no more than the transfer
        buffer holds (a longer prompt could never be handed to the sender)."""
        if self.sender == "none":
            return self.max_prompt_tokens
        return min(self.max_prompt_tokens, self.transfer.num_blocks * self.transfer.block_size)
