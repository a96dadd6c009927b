"""The request bodies of the peer benchmark: OpenAI chat completions, streamed, 32 tokens.

Workloads: ``text`` (a ~40-token prompt), ``image`` (one fresh 448x448 PNG), ``four_images``
(four fresh ones), ``repeated_image`` (the same image in every request, fresh text) and
``json_schema`` (``text`` whose answer must follow a JSON schema: structured output), and the
video ones, not in the default set: ``video_10s`` / ``video_60s`` (a fresh clip of 10 or 60
seconds, ``videos.py``) and ``repeated_video`` (the same 60 s clip every time). Every
prompt starts with a random number, and fresh images are random noise, so no prefix or image
cache hits across requests except the repeated image's (the intended one). Images go first in
the message (the way clients send "this picture: question"), the text after them. Bodies are
serialized before a run starts so that building them costs nothing inside the measured window.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass

import numpy as np
from PIL import Image

from bench.peers import videos

MAX_TOKENS = 32
IMAGE_SIDE = 448
REPEATED_SEED = 20261125
QUESTION = (
    "Please describe, in plain words and in as much detail as you can manage, what this request "
    "is about, which colors, shapes and objects you notice, and what might happen next."
)


# ``json_schema``: an object with one free string, which random weights do not close within
# MAX_TOKENS tokens, so both systems generate all of them under the grammar
JSON_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Workload:
    name: str
    num_images: int
    repeated: bool = False
    structured: bool = False  # the answer under ``JSON_SCHEMA`` (response_format)
    video_s: int = 0  # one clip of this many seconds (0: none)


WORKLOADS = {
    w.name: w
    for w in (
        Workload("text", 0),
        Workload("image", 1),
        Workload("four_images", 4),
        Workload("repeated_image", 1, repeated=True),
        Workload("json_schema", 0, structured=True),
        Workload("video_10s", 0, video_s=10),
        Workload("video_60s", 0, video_s=60),
        Workload("repeated_video", 0, repeated=True, video_s=60),
    )
}
DEFAULT_WORKLOADS = tuple(name for name, w in WORKLOADS.items() if not w.video_s)
REPEATED_VIDEO_SEED = 20261126


def noise_png(rng: np.random.Generator, side: int = IMAGE_SIDE) -> bytes:
    """A ``side`` x ``side`` PNG of random pixels (fast compression: it does not compress)."""
    pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


_repeated: dict[int, str] = {}


def repeated_image_url(side: int = IMAGE_SIDE) -> str:
    """The one image of ``repeated_image``: the same for every request and both systems."""
    if side not in _repeated:
        _repeated[side] = data_url(noise_png(np.random.default_rng(REPEATED_SEED), side))
    return _repeated[side]


def prompt(rng: np.random.Generator) -> str:
    """A fresh ~40-token prompt: a random number first, so prefix caches cannot hit."""
    return f"Request {int(rng.integers(10**9, 10**10))}. {QUESTION}"


def body(
    workload: Workload,
    model: str,
    rng: np.random.Generator,
    max_tokens: int = MAX_TOKENS,
    side: int = IMAGE_SIDE,
) -> dict:
    """One streamed chat completion request of ``workload`` for ``model``."""
    if workload.repeated:
        urls = [repeated_image_url(side)] * workload.num_images
    else:
        urls = [data_url(noise_png(rng, side)) for _ in range(workload.num_images)]
    text = prompt(rng)
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    if workload.video_s:
        clip_rng = np.random.default_rng(REPEATED_VIDEO_SEED) if workload.repeated else rng
        url = videos.video_url(videos.make_clip(clip_rng, workload.video_s))
        parts.append({"type": "video_url", "video_url": {"url": url}})
    if parts:
        content: str | list[dict] = [*parts, {"type": "text", "text": text}]
    else:
        content = text
    out = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if workload.structured:
        schema = {"name": "answer", "schema": JSON_SCHEMA, "strict": True}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    return out


def bodies(
    workload: Workload,
    model: str,
    num: int,
    rng: np.random.Generator | None = None,
    max_tokens: int = MAX_TOKENS,
) -> list[bytes]:
    """``num`` serialized request bodies (fresh randomness from the OS unless ``rng``)."""
    rng = rng or np.random.default_rng()
    return [json.dumps(body(workload, model, rng, max_tokens)).encode() for _ in range(num)]
