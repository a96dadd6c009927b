"""Encoded bytes -> an RGB ``PIL.Image``, in two steps so limits come before pixels.

* ``open_image`` reads only the header (PIL opens lazily) and checks the size limits there: a
  decompression bomb or an over-long prompt is refused without allocating any pixels (PIL's own
  global ``MAX_IMAGE_PIXELS`` is left untouched).
* ``load_rgb`` decodes the pixels, applies the EXIF orientation and converts every mode to 8-bit
  RGB (``color.to_rgb``: transparency on white, 16-bit and float images scaled).
* Animated images (GIF, APNG, WebP): only the first frame is used.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from .color import to_rgb
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


def open_image(data: bytes, limits: DecodeLimits) -> Image.Image:
    """``data`` opened lazily (header read, no pixels decoded) after its size passed ``limits``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidInput(f"image refused as a decompression bomb ({exc})") from None
    except UnidentifiedImageError:
        raise InvalidInput("data is not an image in a supported format") from None
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as exc:
        raise InvalidInput(f"corrupt or truncated image ({exc})") from None
    check_size(img.width, img.height, limits)
    return img


def load_rgb(img: Image.Image) -> Image.Image:
    """Decode an image from ``open_image``: first frame, EXIF orientation, 8-bit RGB."""
    try:
        img.seek(0)  # NOTE: first frame of an animation
        img.load()
        ImageOps.exif_transpose(img, in_place=True)
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as exc:
        raise InvalidInput(f"corrupt or truncated image ({exc})") from None
    return to_rgb(img)


def decode_image(data: bytes, limits: DecodeLimits) -> Image.Image:
    """Decode ``data`` to an RGB image that satisfies ``limits``."""
    return load_rgb(open_image(data, limits))
