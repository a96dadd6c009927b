"""Image by image and prefill while receiving, on vs off: TTFT of multi-image requests.

One stack with the encoder shipping each image as the ViT finishes it and the language worker
prefilling what landed (the defaults), one with both off (the whole prompt is encoded, shipped
and only then prefilled); the same requests — 4 distinct large images each, no cache hits — run
one at a time on each, alternating stacks, so the ratio is measured side by side in one run.
``python -m bench.overlap [--quick] [--size demo|bench] [--images N] [--side PX]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from bench.e2e import STARTUP_S, Request, png, stream_one
from common.models.tiny import ensure_tiny_model
from services.gateway.client import GatewayClient
from services.local_stack import start_local_stack


def noise_image(seed: int, side: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


KV_ENV = {"EPD_LANGUAGE_KV_CACHE_MEMORY_MB": "2048"}  # two stacks share the host
OFF_ENV = {
    **KV_ENV,
    "EPD_ENCODER_SHIP_PER_IMAGE": "false",
    "EPD_LANGUAGE_PREFILL_WHILE_RECEIVING": "false",
}
MAX_TOKENS = 4
PROMPT = "Describe each of these pictures."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="3 requests per side instead of 8")
    parser.add_argument(
        "--size", choices=("demo", "bench"), default="demo", help="generated Qwen2.5-VL checkpoint"
    )
    parser.add_argument("--images", type=int, default=4, help="images per request")
    parser.add_argument(
        "--side",
        type=int,
        default=1344,
        help="image width and height, pixels (1344: each image a ViT forward of its own)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="compute threads per worker process (OMP_NUM_THREADS; 1: the encoder and the "
        "language worker each get a core of their own, as on separate devices; 0: torch's "
        "default, both compete for every core)",
    )


def bench(args: argparse.Namespace) -> dict:
    model_dir = Path(ensure_tiny_model("qwen2_5_vl", args.size))
    rounds = 3 if args.quick else 8
    threads = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    ttft: dict[str, list[float]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="epd-bench-overlap-") as log_dir:
        for name in ("on", "off"):
            (Path(log_dir) / name).mkdir()
        with contextlib.ExitStack() as running:
            clients = {}
            for name, env in (("on", KV_ENV), ("off", OFF_ENV)):
                stack = start_local_stack(
                    model_dir,
                    Path(log_dir) / name,
                    env={**env, **threads},
                    startup_timeout_s=STARTUP_S,
                )
                running.enter_context(stack.serving())
                clients[name] = running.enter_context(GatewayClient(stack.gateway.address))
            seed = 10_000
            for i in range(rounds + 1):  # the first round warms up
                order = ("on", "off") if i % 2 else ("off", "on")
                for name in order:
                    images = [noise_image(seed + k, args.side) for k in range(args.images)]
                    seed += args.images
                    request = Request(PROMPT, images, [png(im) for im in images])
                    first, _, _ = stream_one(clients[name], request)
                    if i:
                        ttft[name].append(first)
    on, off = statistics.median(ttft["on"]), statistics.median(ttft["off"])
    return {
        "model": str(model_dir),
        "images": args.images,
        "side": args.side,
        "rounds": rounds,
        "threads": args.threads,
        "ttft_on_ms": on * 1e3,
        "ttft_off_ms": off * 1e3,
        "speedup": off / on,
    }


def format_table(result: dict) -> str:
    return "\n".join(
        [
            f"model {result['model']}: {result['images']} images of {result['side']}² per "
            f"request, {result['rounds']} requests per side, one at a time, "
            f"{result['threads'] or 'default'} compute thread(s) per process",
            f"TTFT p50, image by image + prefill while receiving: {result['ttft_on_ms']:.0f} ms",
            f"TTFT p50, whole prompt first (both off):             {result['ttft_off_ms']:.0f} ms",
            f"speedup: {result['speedup']:.2f}x",
        ]
    )


def run(args: argparse.Namespace) -> int:
    result = bench(args)
    print(json.dumps(result) if args.json else format_table(result), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.overlap", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
