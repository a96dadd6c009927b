"""Encoder benchmark: images/s at batch 1 vs batched, and cache-hit vs miss latency.

Runs the in-process ``EncoderPipeline`` (no gRPC, no transfer) on a generated Qwen2.5-VL
checkpoint (``--size demo``, or ``bench``: Qwen2.5-VL-3B's vision widths, 4 blocks) with
448x448 and 1344x1344 images.
``python -m bench.encoder [--num-images N] [--device auto|cpu|cuda] [--size demo|bench]``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
from PIL import Image

from common.models.tiny import ensure_tiny_model
from services.encoder.config import EncoderConfig
from services.encoder.pipeline import EncoderPipeline

SIZES = (448, 1344)


def _images(size: int, num: int, seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(num)
    ]


def _turn() -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]


def batch1_rate(pipe: EncoderPipeline, images: list[Image.Image]) -> float:
    start = time.perf_counter()
    for img in images:
        pipe.encode(_turn(), [img])
    return len(images) / (time.perf_counter() - start)


def batched_rate(pipe: EncoderPipeline, images: list[Image.Image]) -> float:
    start = time.perf_counter()
    prompts = [pipe.prepare(_turn(), [img]) for img in images]
    left = threading.Semaphore(0)
    for prompt in prompts:
        pipe.submit(prompt, lambda encoded, error: left.release())
    for _ in prompts:
        left.acquire()
    return len(images) / (time.perf_counter() - start)


def cache_latency(pipe: EncoderPipeline, img: Image.Image, repeats: int) -> tuple[float, float]:
    """(miss seconds, median hit seconds), end to end through ``encode``."""
    start = time.perf_counter()
    pipe.encode(_turn(), [img])
    miss = time.perf_counter() - start
    hits = []
    for _ in range(repeats):
        start = time.perf_counter()
        assert pipe.encode(_turn(), [img]).num_cache_hits == 1
        hits.append(time.perf_counter() - start)
    return miss, statistics.median(hits)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=int, default=8, help="images per throughput run")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--size", choices=("demo", "bench"), default="demo")
    args = parser.parse_args(argv)
    path = ensure_tiny_model("qwen2_5_vl", args.size)
    rows = []
    for size in SIZES:
        num = args.num_images if size < 1000 else max(2, args.num_images // 2)
        no_cache = EncoderConfig(  # every queued image in one forward: batching's own gain
            device=args.device,
            cache_mb=0,
            max_batch_patches=1 << 20,
            max_batch_ms=0,
            max_prompt_tokens=1 << 20,
        )
        pipe = EncoderPipeline(path, no_cache)
        pipe.encode(_turn(), _images(size, 1, 99))  # warm-up
        single = batch1_rate(pipe, _images(size, num, 1))
        batched = batched_rate(pipe, _images(size, num, 2))
        pipe.close()
        pipe = EncoderPipeline(path, EncoderConfig(device=args.device, max_prompt_tokens=1 << 20))
        miss, hit = cache_latency(pipe, _images(size, 1, 3)[0], repeats=5)
        pipe.close()
        rows.append((size, num, single, batched, miss, hit))
    print(f"encoder bench: {path.name}, device {args.device}")
    header = (
        f"{'image':>10} {'n':>3} {'batch1 img/s':>13} {'batched img/s':>14} {'ratio':>6} "
        f"{'miss ms':>8} {'hit ms':>7} {'miss/hit':>9}"
    )
    print(header)
    for size, num, single, batched, miss, hit in rows:
        print(
            f"{f'{size}x{size}':>10} {num:>3} {single:>13.2f} {batched:>14.2f} "
            f"{batched / single:>6.2f} {miss * 1e3:>8.1f} {hit * 1e3:>7.1f} {miss / hit:>9.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
