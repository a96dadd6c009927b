"""Domain objects of the encoder: what a request is, and what encoding it produces."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import torch
from PIL import Image

SOURCE_KINDS = ("data", "base64", "path", "url")


@dataclass(frozen=True)
class ImageSource:
    """Where one image comes from: ``kind`` in SOURCE_KINDS, ``value`` bytes or str."""

    kind: str
    value: bytes | str

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"unknown image source kind {self.kind!r}")


@dataclass(frozen=True)
class VideoSampling:
    """How frames are taken from a video and sized; 0 = the encoder's default for each."""

    fps: float = 0.0  # frames sampled per second of video
    min_frames: int = 0
    max_frames: int = 0
    min_pixels: int = 0  # per-frame smart_resize bounds
    max_pixels: int = 0
    total_pixels: int = 0  # all sampled frames together

    def __post_init__(self) -> None:
        if not self.fps >= 0 or self.fps == float("inf"):
            raise ValueError(f"fps must be a finite number >= 0, got {self.fps}")
        for name in ("min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class VideoInput:
    """One video of a request: an encoded file (``ImageSource`` or bytes) and its sampling."""

    source: ImageSource | bytes
    sampling: VideoSampling = VideoSampling()


@dataclass(frozen=True)
class ContentPart:
    """Exactly one of ``text`` / ``image`` (an ``ImageSource``, a PIL image or encoded bytes) /
    ``video``."""

    text: str | None = None
    image: ImageSource | Image.Image | bytes | None = None
    video: VideoInput | None = None


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: tuple[ContentPart, ...]


@dataclass(frozen=True)
class RequestLimits:
    """Per-request limits; each only tightens the server's (0 = the server's)."""

    max_images: int = 0
    max_prompt_tokens: int = 0


@dataclass(frozen=True)
class EncodeRequest:
    room: int
    request_id: str
    messages: tuple[ChatMessage, ...]
    limits: RequestLimits = RequestLimits()
    timeout_s: float = 0.0  # seconds the request has left; 0 = the encoder's default


@dataclass(eq=False)
class PreparedImage:
    """One decoded and resized image of a request: either its patches, waiting for the ViT, or
    its rows, found in the cache at admission. Requests never share these objects (the same
    image twice in one request is one object)."""

    key: bytes  # 16-byte cache key: pixels + preprocessing parameters + model revision
    grid_thw: tuple[int, int, int]  # in patches
    num_tokens: int  # t*h*w / merge**2: rows (image tokens) it yields
    # [t*h*w, C*tp*p*p] patches in the tower's dtype, until consumed
    pixel_values: torch.Tensor | None = None
    rows: torch.Tensor | None = None  # [num_tokens, row_width] wire dtype: a cache hit
    held_bytes: int = 0  # share of the pixel budget held for its patches (0 once given back)
    # a video frame group's patches, cut when the ViT takes the group (``patches``): its
    # decoded frames wait instead of the floats, and the Encode call does not cut them all
    pending: PendingPatches | None = None

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def patch_bytes(self) -> int:
        """What its patches take (or will take, once cut)."""
        if self.pixel_values is not None:
            return self.pixel_values.numel() * self.pixel_values.element_size()
        return self.pending.nbytes if self.pending is not None else 0

    def patches(self) -> torch.Tensor:
        """Its patches, cut now when they are pending (the ViT thread's call)."""
        if self.pixel_values is None and self.pending is not None:
            self.pixel_values, self.pending = self.pending.cut(), None
        if self.pixel_values is None:
            raise RuntimeError("the image's patches were given back")
        return self.pixel_values


@dataclass(frozen=True)
class PendingPatches:
    """Patches not cut yet: ``cut()`` makes them (``nbytes`` of them)."""

    cut: Callable[[], torch.Tensor]
    nbytes: int


@dataclass(eq=False)
class PreparedVideo:
    """One sampled and resized video of a request: a sequence of frame groups (``temporal_patch``
    frames each), every group one ViT unit of grid ``(1, h, w)``. The ViT attends within a
    frame group only, so encoding the groups apart gives the rows of the whole video.

    Its identity (``key``: pad id, radix key, affinity) covers the sampled pixels *and* the
    sampling settings: the same clip sampled differently is another video."""

    key: bytes  # 16 bytes: sampled frames + sampling + preprocessing + model revision
    grid_thw: tuple[int, int, int]  # (frame groups, h, w) in patches
    groups: list[PreparedImage]  # one per frame group, in time order
    second_per_grid_t: float  # seconds of video one frame group spans (Qwen2.5-VL's M-RoPE)
    timestamps: list[float]  # seconds, the middle of each frame group (Qwen3-VL's prompt)
    num_frames: int  # frames sampled (decoded)

    @property
    def num_tokens(self) -> int:
        return sum(group.num_tokens for group in self.groups)


MediaItem = PreparedImage | PreparedVideo


@dataclass
class Prompt:
    """A tokenized prompt before the ViT runs: fill ids, positions, the media in order.

    ``items`` are the request's images and videos in prompt order (its identity: one hash and
    one pad id each); ``images`` are the ViT units in token order: each image, and each frame
    group of each video."""

    fill_ids: np.ndarray  # int32 [L]; image / video tokens carry their item's pad id
    positions: np.ndarray  # int32 [3, L] M-RoPE (t, h, w)
    mrope_delta: int
    image_mask: np.ndarray  # bool [L]: the tokens that get rows (image and video)
    images: list[PreparedImage] = field(default_factory=list)
    items: list[MediaItem] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.fill_ids.shape[0])

    @property
    def num_videos(self) -> int:
        return sum(isinstance(item, PreparedVideo) for item in self.items)

    @property
    def num_video_frames(self) -> int:
        return sum(item.num_frames for item in self.items if isinstance(item, PreparedVideo))


@dataclass
class EncodedPrompt:
    """A fully encoded prompt: what the language side receives for one room."""

    fill_ids: np.ndarray  # int32 [L]
    positions: np.ndarray  # int32 [3, L]
    image_rows: torch.Tensor  # [M, hidden*(1+num_deepstack)] in the wire dtype, token order (CPU)
    image_mask: np.ndarray  # bool [L], True at the M image tokens
    mrope_delta: int
    num_items: int  # images
    image_hashes: list[str]  # hex cache key per image
    image_token_counts: list[int]
    num_cache_hits: int = 0
    encode_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return int(self.fill_ids.shape[0])


class RoomStatus(IntEnum):
    """Where an accepted request is. Forward only; FAILED is final."""

    QUEUED = 0  # accepted, images waiting for the ViT
    ENCODED = 1  # rows computed, waiting for sender blocks
    SUBMITTED = 2  # handed to the sender; the receiver pulls it
    SHIPPED = 3  # the sender reports the transfer complete
    FAILED = 4
