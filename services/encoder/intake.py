"""Request images -> validated RGB images: source policy, decoding and size limits together."""

from __future__ import annotations

from PIL import Image

from .config import EncoderConfig
from .decode import DecodeLimits, check_size, decode_image, to_rgb
from .errors import InvalidInput
from .sources import SourcePolicy, read_source
from .types import ImageSource

ImageInput = ImageSource | Image.Image | bytes


class ImageIntake:
    def __init__(self, config: EncoderConfig) -> None:
        self.policy = SourcePolicy(
            max_bytes=config.max_image_bytes,
            allowed_dirs=config.allowed_dirs,
            allow_urls=config.allow_urls,
            allow_private_urls=config.allow_private_urls,
            url_timeout_s=config.url_timeout_s,
        )
        self.limits = DecodeLimits(
            max_pixels=config.max_image_pixels,
            min_side=config.min_image_side,
            max_aspect_ratio=config.max_aspect_ratio,
        )

    def load(self, item: ImageInput, index: int) -> Image.Image:
        """The RGB image of ``item`` (the ``index``-th image of its request, for errors)."""
        try:
            if isinstance(item, Image.Image):
                check_size(item.width, item.height, self.limits)
                return to_rgb(item)
            if isinstance(item, (bytes, bytearray, memoryview)):
                item = ImageSource("data", bytes(item))
            return decode_image(read_source(item, self.policy), self.limits)
        except InvalidInput as exc:
            if exc.item is not None:
                raise
            raise InvalidInput(str(exc), item=index) from None
