"""Bounds of a video content part at the gateway (sizes and shapes only; nothing is decoded:
the encoder probes the container and refuses a bad video naming it)."""

from __future__ import annotations

import math

from protos.epd.v1 import common_pb2
from services.gateway.media_sources import validate_source

MAX_FPS = 1000.0  # beyond any real frame rate; the encoder bounds it further


def validate_video(video: common_pb2.VideoPart, where: str, limits, invalid) -> None:
    """Raise ``invalid(msg)`` (a ``GatewayError``) naming the first field of ``video`` out of
    bounds; ``limits`` is the gateway's ``RequestLimits``."""
    bounds = (limits.max_video_bytes, limits.max_image_ref_chars)
    validate_source(video.source, f"{where}.source", *bounds, invalid)
    fps = video.sampling.fps
    if not (math.isfinite(fps) and 0 <= fps <= MAX_FPS):
        raise invalid(f"{where}.sampling.fps must be in [0, {MAX_FPS:g}] (0 = default), got {fps}")
    s = video.sampling
    if s.min_frames and s.max_frames and s.min_frames > s.max_frames:
        raise invalid(f"{where}.sampling.min_frames ({s.min_frames}) > max_frames ({s.max_frames})")
    if s.min_pixels and s.max_pixels and s.min_pixels > s.max_pixels:
        raise invalid(f"{where}.sampling.min_pixels ({s.min_pixels}) > max_pixels ({s.max_pixels})")
