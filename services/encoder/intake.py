"""Request images -> validated RGB images: source policy, header limits, then decoding.

``open`` reads the source (within its byte limit) and the image header only, and checks the
size limits there; ``decode`` turns what ``open`` returned into 8-bit RGB pixels. Callers check
everything the header tells (size, token count) between the two. Every failure is an
``InvalidInput`` naming the image's index in its request.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from .color import to_rgb
from .config import EncoderConfig
from .decode import DecodeLimits, check_size, load_rgb, open_image
from .errors import InvalidInput
from .sources import SourcePolicy, read_source
from .types import ImageSource, VideoInput
from .video_decode import VideoHeader, VideoLimits, probe_video

ImageInput = ImageSource | Image.Image | bytes


@dataclass(frozen=True)
class OpenedImage:
    """An image whose header passed the limits. ``data``: the encoded bytes it was opened from
    lazily by the intake (pixels not decoded yet, the object is ours); None for a caller's
    decoded image."""

    image: Image.Image
    data: bytes | None = None

    @property
    def encoded(self) -> bool:
        return self.data is not None

    @property
    def width(self) -> int:
        return self.image.width

    @property
    def height(self) -> int:
        return self.image.height


def source_policy(config: EncoderConfig, max_bytes: int, noun: str) -> SourcePolicy:
    """Where a media part may come from (the encoder's settings) and how large it may be."""
    return SourcePolicy(
        max_bytes=max_bytes,
        allowed_dirs=config.allowed_dirs,
        allow_urls=config.allow_urls,
        allow_private_urls=config.allow_private_urls,
        url_timeout_s=config.url_timeout_s,
        noun=noun,
    )


class ImageIntake:
    def __init__(self, config: EncoderConfig) -> None:
        self.policy = source_policy(config, config.max_image_bytes, "image")
        self.limits = DecodeLimits(
            max_pixels=config.max_image_pixels,
            min_side=config.min_image_side,
            max_aspect_ratio=config.max_aspect_ratio,
        )

    def open(self, item: ImageInput, index: int) -> OpenedImage:
        """``item`` (the ``index``-th image of its request) with its header checked; an encoded
        image is not decoded yet (its size is known, its pixels are not)."""
        with naming(index):
            if isinstance(item, Image.Image):
                check_size(item.width, item.height, self.limits)
                return OpenedImage(item)
            if isinstance(item, (bytes, bytearray, memoryview)):
                item = ImageSource("data", bytes(item))
            data = read_source(item, self.policy)
            return OpenedImage(open_image(data, self.limits), data)

    def decode(self, opened: OpenedImage, index: int) -> Image.Image:
        """The 8-bit RGB pixels of an image from ``open``."""
        with naming(index):
            return load_rgb(opened.image) if opened.encoded else to_rgb(opened.image)

    def load(self, item: ImageInput, index: int) -> Image.Image:
        """``open`` and ``decode`` in one step."""
        return self.decode(self.open(item, index), index)


@dataclass(frozen=True)
class OpenedVideo:
    """A video whose header and packets passed the limits; no frame decoded yet."""

    data: bytes
    header: VideoHeader
    video: VideoInput


class VideoIntake:
    """Request videos -> bytes and a checked header: the image sources' policy with the video
    byte limit, then ``probe_video``'s header and packet checks."""

    def __init__(self, config: EncoderConfig) -> None:
        self.policy = source_policy(config, config.max_video_bytes, "video")
        self.limits = VideoLimits(
            max_seconds=config.max_video_seconds,
            max_frames=config.max_video_source_frames,
            max_streams=config.max_video_streams,
            frame=DecodeLimits(
                max_pixels=config.max_video_frame_pixels,
                min_side=config.min_image_side,
                max_aspect_ratio=config.max_aspect_ratio,
            ),
        )

    def open(self, video: VideoInput, index: int) -> OpenedVideo:
        """The ``index``-th video of its request, read and probed (``InvalidInput`` naming it)."""
        with naming(index, "video"):
            source = video.source
            if isinstance(source, (bytes, bytearray, memoryview)):
                source = ImageSource("data", bytes(source))
            data = read_source(source, self.policy)
            return OpenedVideo(data, probe_video(data, self.limits), video)


class naming:
    """Re-raise an ``InvalidInput`` without an item index as one naming ``index``."""

    def __init__(self, index: int, kind: str = "image") -> None:
        self.index = index
        self.kind = kind

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if isinstance(exc, InvalidInput) and exc.item is None:
            raise InvalidInput(str(exc), item=self.index, kind=self.kind) from None
        return False
