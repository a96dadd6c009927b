"""The clips of the peer benchmark's video workloads, made at run time with PyAV.

Each clip is ``fps`` frames per second of ``side`` x ``side`` pixels at that native rate, so that
both systems, which sample video at 2 frames per second by default, take every frame and agree
on the prompt (the benchmark prints both systems' prompt tokens). Frames are blocky random
noise moving sideways, fresh for every clip unless ``seed`` is fixed (the repeated clip).
"""

from __future__ import annotations

import base64
import io

import av
import numpy as np

CLIP_FPS = 2
CLIP_SIDE = 336  # 12 x 28: Qwen-VL keeps it as it is (within its per-frame pixel bounds)


def make_clip(rng: np.random.Generator, seconds: int, side: int = CLIP_SIDE) -> bytes:
    """An MP4 (MPEG-4 part 2) of ``seconds`` at ``CLIP_FPS``, ``side`` pixels square."""
    base = rng.integers(0, 256, (side // 16 + 1, side // 16 + 1, 3), dtype=np.uint8)
    big = np.kron(base, np.ones((16, 16, 1), np.uint8))[:side, :side]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=CLIP_FPS)
        stream.width = stream.height = side
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "4"}
        for i in range(seconds * CLIP_FPS):
            frame = av.VideoFrame.from_ndarray(np.roll(big, 8 * i, axis=1), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def video_url(clip: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(clip).decode()
