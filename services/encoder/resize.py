"""Qwen-VL's smart_resize: the size an image is resized to before it is cut into patches."""

from __future__ import annotations

import math


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) rounded to multiples of ``factor`` with area in [min_pixels, max_pixels].

    ``factor`` is patch_size * merge_size (28 for Qwen2/2.5-VL, 32 for Qwen3-VL). The aspect
    ratio is kept as well as the rounding allows; callers enforce the aspect-ratio limit first.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"invalid image size {width}x{height}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
