"""Any decoded PIL image -> 8-bit RGB, the only input the image processor takes.

* Alpha (or palette transparency) is composited on white.
* High-bit-depth and float grey images are scaled, never clipped: PIL's own ``convert`` clips
  16-bit values above 255 to white and maps [0, 1] floats to black. The range mapped onto
  0..255 is the format's full range where it has one and the image's own otherwise:

  ==================  ===================================================================
  mode                range mapped to 0..255
  ==================  ===================================================================
  ``I;16*``           0..65535 (16-bit PNG / TIFF)
  ``I`` (int32)       0..65535 when every value fits in 16 bits (PIL reads some 16-bit
                      files this way), else the image's min..max
  ``F`` (float32)     0..1 when every value lies in it (normalized intensities), else the
                      image's min..max (linear / HDR data have no fixed range)
  ==================  ===================================================================

  Non-finite float values count as the range's ends (NaN and -inf as the low end). A
  constant image whose value lies outside its format's range becomes black.
* 16-bit RGB(A) PNGs need nothing here: PIL reads them as 8-bit RGB(A), keeping the high byte.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
UINT16_MAX = 65535


def is_high_depth(mode: str) -> bool:
    return mode == "I" or mode == "F" or mode.startswith("I;16")


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB version of ``img`` (``img`` itself when it is RGB already)."""
    if img.mode == "RGB":
        return img
    if is_high_depth(img.mode):
        return to_8bit_grey(img).convert("RGB")
    if img.mode in ALPHA_MODES or "transparency" in img.info:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def to_8bit_grey(img: Image.Image) -> Image.Image:
    """An ``L`` image of a high-depth grey ``img``, its range (see the table) mapped to 0..255."""
    values = np.asarray(img).astype(np.float32)
    low, high = value_range(img.mode, values)
    values = np.nan_to_num(values, nan=low, posinf=high, neginf=low)
    if high > low:
        scaled = (values - low) * np.float32(255.0 / (high - low))
    else:
        scaled = np.zeros_like(values)
    return Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8), "L")


def value_range(mode: str, values: np.ndarray) -> tuple[float, float]:
    """The (low, high) values of ``mode`` that become 0 and 255."""
    if mode.startswith("I;16"):
        return 0.0, float(UINT16_MAX)
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return 0.0, 1.0
    low, high = float(finite.min()), float(finite.max())
    if mode == "I" and low >= 0 and high <= UINT16_MAX:
        return 0.0, float(UINT16_MAX)
    if mode == "F" and low >= 0 and high <= 1:
        return 0.0, 1.0
    return low, high
