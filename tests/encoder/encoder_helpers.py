"""Builders shared by the encoder tests."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def noise_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8), mode)


def encode_bytes(img: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def user_turn(num_images: int, text: str = "Describe the picture.") -> list[dict]:
    content = [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]
