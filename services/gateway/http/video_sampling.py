"""Video sampling settings on the HTTP API -> each video part's ``VideoSampling``.

A chat request sets them the way vLLM users send them: request-wide in ``mm_processor_kwargs``
(applied to every video of the request; images are not affected), and per video inside its
``video_url`` object next to ``url``. Precedence, key by key: a key in the part's ``video_url``
wins over the same key in ``mm_processor_kwargs``; a key set in neither takes the encoders'
default. The keys are qwen-vl-utils' (``KEYS``); each must be positive (0 would travel as
"unset"), integers must be JSON integers, and a minimum may not exceed its maximum once both
levels are merged. Any other key, or a bad value, is a 400 naming the field's JSON path. The
encoders still bound each value by their own configuration (a request may ask for less, never
more).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from protos.epd.v1 import common_pb2
from services.gateway.http.errors import invalid
from services.gateway.video_validation import MAX_FPS

MAX_UINT32 = (1 << 32) - 1
MAX_UINT64 = (1 << 64) - 1
REQUEST_FIELD = "mm_processor_kwargs"
# key -> (JSON type, largest value); the key is also the ``VideoSampling`` field's name
MIN_FPS = 1e-3  # a frame per ~17 minutes; smaller values would round to 0 ("unset") as float32
KEYS: dict[str, tuple[str, int | float]] = {
    "fps": ("number", MAX_FPS),
    "min_frames": ("integer", MAX_UINT32),
    "max_frames": ("integer", MAX_UINT32),
    "min_pixels": ("integer", MAX_UINT32),
    "max_pixels": ("integer", MAX_UINT32),
    "total_pixels": ("integer", MAX_UINT64),
}
PAIRS = (("min_frames", "max_frames"), ("min_pixels", "max_pixels"))
DESCRIPTIONS = {
    "fps": "frames sampled per second of video",
    "min_frames": "sample at least this many frames (as the video has them)",
    "max_frames": "sample at most this many frames (rounded down to a multiple of 2)",
    "min_pixels": "per-frame resize bound, in pixels",
    "max_pixels": "per-frame resize bound, in pixels",
    "total_pixels": "pixel budget of all sampled frames of one video together",
}


def key_schemas() -> dict[str, dict]:
    """The JSON schema of each key, for ``/openapi.json``."""
    out = {}
    for key, (kind, largest) in KEYS.items():
        least = MIN_FPS if kind == "number" else 1
        out[key] = {
            "type": kind,
            "minimum": least,
            "maximum": largest,
            "description": DESCRIPTIONS[key],
        }
    return out


MM_PROCESSOR_KWARGS_SCHEMA = {
    "anyOf": [
        {"type": "object", "properties": key_schemas(), "additionalProperties": False},
        {"type": "null"},
    ],
    "description": "extension (vLLM): video sampling of every video of the request; a key set "
    "in a video_url object wins for that video",
}


def request_sampling(raw: Any) -> common_pb2.VideoSampling:
    """The request-wide settings of ``mm_processor_kwargs`` (None: none); 400 when bad."""
    if raw is None:
        return common_pb2.VideoSampling()
    if not isinstance(raw, dict):
        raise invalid(f"{REQUEST_FIELD} must be an object", REQUEST_FIELD)
    return _sampling(raw, REQUEST_FIELD)


def part_sampling(video_url: dict, where: str) -> common_pb2.VideoSampling:
    """The settings a ``video_url`` object (at JSON path ``where``) sets beside its ``url``."""
    return _sampling({k: v for k, v in video_url.items() if k != "url"}, where)


def apply_request_sampling(
    messages: Iterable[common_pb2.ChatMessage], request: common_pb2.VideoSampling
) -> None:
    """Fill each video part's unset keys from ``request`` and check the merged minimums."""
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content):
            if part.WhichOneof("part") != "video":
                continue
            sampling = part.video.sampling
            where = f"messages[{i}].content[{j}].video_url"
            origin = {key: where if getattr(sampling, key) else REQUEST_FIELD for key in KEYS}
            for key in KEYS:
                if not getattr(sampling, key):
                    setattr(sampling, key, getattr(request, key))
            _check_pairs(sampling, origin)


def _sampling(raw: dict, where: str) -> common_pb2.VideoSampling:
    sampling = common_pb2.VideoSampling()
    for key, value in raw.items():
        if key not in KEYS:
            allowed = ", ".join(KEYS)
            raise invalid(
                f"{where}.{key} is not a video sampling key ({allowed})", f"{where}.{key}"
            )
        setattr(sampling, key, _value(key, value, f"{where}.{key}"))
    _check_pairs(sampling, dict.fromkeys(KEYS, where))
    return sampling


def _value(key: str, value: Any, path: str) -> float | int:
    """``value`` of ``key`` checked: its JSON type, finite, in [1 (``MIN_FPS``), largest]."""
    kind, largest = KEYS[key]
    if kind == "integer":
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(f"{path} must be an integer, got {_shown(value)}", path)
        if not 1 <= value <= largest:
            raise invalid(f"{path} must be in [1, {largest}], got {value}", path)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{path} must be a number, got {_shown(value)}", path)
    if not (math.isfinite(value) and MIN_FPS <= value <= largest):
        raise invalid(
            f"{path} must be a finite number in [{MIN_FPS:g}, {largest:g}], got {value}", path
        )
    return float(value)


def _check_pairs(sampling: common_pb2.VideoSampling, origin: dict[str, str]) -> None:
    """Each minimum at most its maximum (both set); ``origin``: where each key was set."""
    for low, high in PAIRS:
        low_value, high_value = getattr(sampling, low), getattr(sampling, high)
        if low_value and high_value and low_value > high_value:
            path = f"{origin[low]}.{low}"
            raise invalid(
                f"{path} ({low_value}) must be at most {origin[high]}.{high} ({high_value})", path
            )


def _shown(value: Any) -> str:
    """A wrong-typed value in JSON's words (``null``, ``true``, an object, a list, ``'x'``)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, str):
        return repr(value)
    return {dict: "an object", list: "a list"}.get(type(value), type(value).__name__)
