"""Bounds of a video content part at the gateway (sizes and shapes only; nothing is decoded:
the encoder probes the container and refuses a bad video naming it)."""

from __future__ import annotations

import math

from protos.epd.v1 import common_pb2

MAX_FPS = 1000.0  # beyond any real frame rate; the encoder bounds it further


def validate_video(video: common_pb2.VideoPart, where: str, limits, invalid) -> None:
    """Raise ``invalid(msg)`` (a ``GatewayError``) naming the first field of ``video`` out of
    bounds; ``limits`` is the gateway's ``RequestLimits``."""
    source = video.source.WhichOneof("source")
    if source is None:
        raise invalid(f"{where}.source has no source (set data, base64, path or url)")
    value = getattr(video.source, source)
    if not value:
        raise invalid(f"{where}.source.{source} is empty")
    if source == "data":
        bound, unit = limits.max_video_bytes, "bytes"
    elif source == "base64":
        bound, unit = base64_chars(limits.max_video_bytes), "characters"
    else:
        bound, unit = limits.max_image_ref_chars, "characters"
        if "\x00" in value:
            raise invalid(f"{where}.source.{source} must not contain NUL characters")
    if len(value) > bound:
        raise invalid(
            f"{where}.source.{source} is {len(value)} {unit}, more than the limit of {bound} {unit}"
        )
    fps = video.sampling.fps
    if not (math.isfinite(fps) and 0 <= fps <= MAX_FPS):
        raise invalid(f"{where}.sampling.fps must be in [0, {MAX_FPS:g}] (0 = default), got {fps}")
    s = video.sampling
    if s.min_frames and s.max_frames and s.min_frames > s.max_frames:
        raise invalid(f"{where}.sampling.min_frames ({s.min_frames}) > max_frames ({s.max_frames})")
    if s.min_pixels and s.max_pixels and s.min_pixels > s.max_pixels:
        raise invalid(f"{where}.sampling.min_pixels ({s.min_pixels}) > max_pixels ({s.max_pixels})")


def base64_chars(num_bytes: int) -> int:
    """The base64 text of ``num_bytes`` bytes with MIME line breaks and a data-URL prefix."""
    chars = 4 * math.ceil(num_bytes / 3)
    return chars + 2 * math.ceil(chars / 76) + 256
