"""Encoded bytes -> an RGB ``PIL.Image``, with the size limits checked before pixels are decoded.

* Size limits are checked on the header, before ``load()``: a decompression bomb is refused
  without allocating its pixels (PIL's own global ``MAX_IMAGE_PIXELS`` is left untouched).
* EXIF orientation is applied.
* Every mode becomes RGB; transparency is composited on white.
* Animated images (GIF, APNG, WebP): only the first frame is used.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import InvalidInput


@dataclass(frozen=True)
class DecodeLimits:
    max_pixels: int = 64_000_000
    min_side: int = 2
    max_aspect_ratio: float = 200.0


def check_size(width: int, height: int, limits: DecodeLimits) -> None:
    """Raise ``InvalidInput`` when a ``width`` x ``height`` image breaks ``limits``."""
    if width * height > limits.max_pixels:
        raise InvalidInput(
            f"image is {width}x{height} = {width * height} pixels; "
            f"the limit is {limits.max_pixels} (decompression bomb?)"
        )
    if min(width, height) < limits.min_side:
        raise InvalidInput(
            f"image is {width}x{height}; each side must be at least {limits.min_side} pixels"
        )
    ratio = max(width, height) / min(width, height)
    if ratio > limits.max_aspect_ratio:
        raise InvalidInput(
            f"image is {width}x{height}, aspect ratio {ratio:.0f}; "
            f"the limit is {limits.max_aspect_ratio:g}"
        )


def decode_image(data: bytes, limits: DecodeLimits) -> Image.Image:
    """Decode ``data`` to an RGB image that satisfies ``limits``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            check_size(img.width, img.height, limits)
            img.seek(0)  # NOTE: first frame of an animation
            img.load()
    except InvalidInput:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidInput(f"image refused as a decompression bomb ({exc})") from None
    except UnidentifiedImageError:
        raise InvalidInput("data is not an image in a supported format") from None
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as exc:
        raise InvalidInput(f"corrupt or truncated image ({exc})") from None
    img = ImageOps.exif_transpose(img)
    return to_rgb(img)


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB copy of ``img``; alpha (or palette transparency) is composited on white."""
    if img.mode == "RGB":
        return img
    has_alpha = img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info
    if has_alpha:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")
