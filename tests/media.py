"""Test videos made at run time with PyAV (no media files in git)."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np


def video_frames(num_frames: int, width: int, height: int, seed: int = 0) -> list[np.ndarray]:
    """Smooth random frames (they survive lossy coding recognisably): RGB uint8 ``[h, w, 3]``."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    big = np.kron(base, np.ones((8, 8, 1), np.uint8))[:height, :width]
    return [np.roll(big, 3 * i, axis=1) for i in range(num_frames)]


def make_video(
    num_frames: int = 12,
    width: int = 64,
    height: int = 48,
    fps: int = 4,
    seed: int = 0,
    codec: str = "mpeg4",
    container: str = "mp4",
    options: dict | None = None,
    rotation: int = 0,
    display_matrix: list[int] | None = None,
    times_ms: list[int] | None = None,
) -> bytes:
    """An encoded video of ``num_frames`` frames at ``fps``; ``rotation``: the display rotation
    its container asks for (degrees counter-clockwise), as a phone writes it; ``display_matrix``:
    a whole display matrix instead (9 int32, FFmpeg's layout), flips included; ``times_ms``: each
    frame's time instead (a variable frame rate; a millisecond time base, one frame each)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=container, options=options or {}) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if times_ms is not None:
            num_frames = len(times_ms)
            stream.time_base = stream.codec_context.time_base = Fraction(1, 1000)
        if rotation:
            stream.set_display_rotation(rotation)
        if display_matrix is not None:
            stream.set_display_matrix(display_matrix)
        for i, frame in enumerate(video_frames(num_frames, width, height, seed)):
            picture = av.VideoFrame.from_ndarray(frame, format="rgb24")
            if times_ms is not None:
                picture.pts, picture.time_base = times_ms[i], Fraction(1, 1000)
            for packet in stream.encode(picture):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def make_audio_only(seconds: float = 1.0, rate: int = 8000, container: str = "mp4") -> bytes:
    """A container with one audio stream (AAC) and no video."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream("aac", rate=rate)
        samples = np.zeros((1, int(seconds * rate)), np.float32)
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def make_empty_video(width: int = 64, height: int = 48) -> bytes:
    """An MP4 with a video stream and no frames."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    return buf.getvalue()


def decoded_frames(data: bytes) -> list[np.ndarray]:
    """Every frame of ``data`` as RGB uint8, decoded independently of the encoder's code."""
    with av.open(io.BytesIO(data)) as src:
        return [f.to_ndarray(format="rgb24") for f in src.decode(video=0)]
