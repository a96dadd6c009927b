"""Builders shared by the encoder tests."""

from __future__ import annotations

import contextlib
import io
import os
import struct
import subprocess
import sys
import threading
import zlib

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


def png16(values: np.ndarray) -> bytes:
    """A 16-bit PNG written by hand (PIL writes 16-bit grey only): ``values`` uint16 ``[h, w]``
    (grey), ``[h, w, 3]`` (RGB) or ``[h, w, 4]`` (RGBA)."""
    color_type = {1: 0, 3: 2, 4: 6}[1 if values.ndim == 2 else values.shape[2]]
    h, w = values.shape[:2]

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    raw = b"".join(b"\x00" + values[y].astype(">u2").tobytes() for y in range(h))
    header = struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def tiff_grey(values: np.ndarray, big_endian: bool = True) -> bytes:
    """A one-strip grey TIFF written by hand: uint16, int32 or float32 ``values`` ``[h, w]``
    (PIL writes no big-endian 16-bit TIFF)."""
    order = ">" if big_endian else "<"
    kind = {np.dtype(np.uint16): (16, 1), np.dtype(np.int32): (32, 2)}
    bits, sample_format = kind.get(values.dtype, (32, 3))
    data = values.astype(values.dtype.newbyteorder(order)).tobytes()
    h, w = values.shape
    tags = [  # (tag, type 3 = SHORT / 4 = LONG, value)
        (256, 3, w), (257, 3, h), (258, 3, bits), (259, 3, 1), (262, 3, 1), (273, 4, 0),
        (277, 3, 1), (278, 3, h), (279, 4, len(data)), (339, 3, sample_format),
    ]  # fmt: skip
    data_at = 8 + 2 + 12 * len(tags) + 4
    out = (b"MM\x00\x2a" if big_endian else b"II\x2a\x00") + struct.pack(order + "IH", 8, len(tags))
    for tag, typ, value in tags:
        value = data_at if tag == 273 else value
        fmt = "HHIHH" if typ == 3 else "HHII"
        out += struct.pack(order + fmt, tag, typ, 1, value, *((0,) if typ == 3 else ()))
    return out + struct.pack(order + "I", 0) + data


@contextlib.contextmanager
def encoder_process(model_dir, *args: str, env: dict | None = None, startup_s: float = 90.0):
    """An encoder server in its own process (``python -m services.encoder.server``); yields
    ``(address, lines)`` where ``lines`` keeps filling with its output (drained by a thread, so
    the child never blocks on a full pipe). Stopped with SIGTERM, which must exit cleanly — at
    once (``--drain-timeout-s 0``): the rooms its tests leave for receivers that never come are
    not awaited (draining is the e2e drain tests' business)."""
    cmd = [
        sys.executable, "-m", "services.encoder.server", "--model-path", str(model_dir),
        "--device", "cpu", "--port", "0", "--drain-timeout-s", "0", *args,
    ]  # fmt: skip
    full_env = dict(os.environ, GLOG_minloglevel="2", MC_LOG_LEVEL="ERROR", **(env or {}))
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env, text=True
    )
    lines: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("encoder listening on "):
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        ready.wait(startup_s)
        started = [line for line in lines if line.startswith("encoder listening on ")]
        if not started:
            raise RuntimeError("encoder did not start:\n" + "".join(lines[-30:]))
        yield started[0].split()[3], lines
        proc.terminate()
        assert proc.wait(timeout=20) == 0, "".join(lines[-30:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
