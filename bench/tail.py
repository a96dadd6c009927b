"""Tail latency under load: TTFT and inter-token p50/p99 at concurrency 16 and 64, mixed work.

Starts a gateway, one encoder and one language worker as processes on 127.0.0.1 (as
``bench.e2e`` does) and streams a mixed workload through the gateway, a quarter of each kind:

* ``text``: text only;
* ``1 image``: one distinct 448x336 image;
* ``4 images``: four distinct 224x224 images;
* ``repeat``: one of two images sent before (same bytes, same prompt): an embedding-cache hit on
  the encoder and a radix-cache hit on the language worker.

Prints TTFT p50/p99, inter-token p50/p99 and requests/s per kind and overall at each
concurrency, and whether TTFT p99 <= 2x p50 at concurrency 16 (the goal). The language worker
serves as many streams as the highest concurrency (``--grpc-workers 64``; its default of 32
would refuse half the requests at 64 with RESOURCE_EXHAUSTED, which the gateway passes on)
unless a ``--language-arg`` sets it; failed requests are counted by reason. Extra server flags
compare an engine option on and off: ``--language-arg=--chunk-size=256`` (repeatable; also
``--encoder-arg``, ``--gateway-arg``).
``python -m bench.tail [--quick] [--size demo|bench] [--json]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np
from PIL import Image

from bench.e2e import STARTUP_S, Request, percentile, png, stream_one
from common.models.tiny import ensure_tiny_model
from services.gateway.client import GatewayClient
from services.local_stack import start_local_stack

KINDS = ("text", "1 image", "4 images", "repeat")
CONCURRENCY = (16, 64)
NUM_REQUESTS = {16: 64, 64: 128}
QUICK_REQUESTS = {16: 32, 64: 64}
NUM_REPEATED = 2  # distinct images the repeat requests cycle through
GOAL_P99_OVER_P50 = 2.0


@dataclass(frozen=True)
class TailRequest:
    kind: str
    request: Request


@dataclass(frozen=True)
class Outcome:
    kind: str
    ttft_s: float
    gaps_s: list[float]
    failed: str  # "" or the gRPC status code name and the start of its details


@dataclass(frozen=True)
class Summary:
    """One kind (or "all") at one concurrency."""

    kind: str
    concurrency: int
    num_requests: int
    num_failed: int
    requests_per_s: float  # of this kind, over the whole run's wall time
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float


def _image(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _request(prompt: str, images: list[Image.Image]) -> Request:
    return Request(prompt, images, [png(im) for im in images])


def repeated_requests() -> list[Request]:
    """The requests the ``repeat`` kind sends again and again (same bytes, same prompt)."""
    rng = np.random.default_rng(4242)
    return [
        _request(f"Repeated picture {i}: what is in it?", [_image(rng, 448, 336)])
        for i in range(NUM_REPEATED)
    ]


def workload(num: int, seed: int, repeated: list[Request]) -> list[TailRequest]:
    """``num`` requests cycling through ``KINDS``; every non-repeat image is new."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        kind = KINDS[i % len(KINDS)]
        prompt = f"Request {seed}-{i}: describe what you see in a few words."
        if kind == "text":
            req = _request(prompt, [])
        elif kind == "1 image":
            req = _request(prompt, [_image(rng, 448, 336)])
        elif kind == "4 images":
            req = _request(prompt, [_image(rng, 224, 224) for _ in range(4)])
        else:
            req = repeated[(i // len(KINDS)) % len(repeated)]
        out.append(TailRequest(kind, req))
    return out


def _send(client: GatewayClient, item: TailRequest) -> Outcome:
    try:
        ttft, gaps, _ = stream_one(client, item.request)
    except grpc.RpcError as exc:
        return Outcome(item.kind, 0.0, [], f"{exc.code().name}: {(exc.details() or '')[:80]}")
    return Outcome(item.kind, ttft, gaps, "")


def summarize(kind: str, concurrency: int, outcomes: list[Outcome], elapsed_s: float) -> Summary:
    ok = [o for o in outcomes if not o.failed]
    ttfts = [o.ttft_s for o in ok]
    gaps = [g for o in ok for g in o.gaps_s]
    return Summary(
        kind,
        concurrency,
        len(outcomes),
        len(outcomes) - len(ok),
        len(ok) / elapsed_s,
        percentile(ttfts, 50) * 1e3,
        percentile(ttfts, 99) * 1e3,
        percentile(gaps, 50) * 1e3,
        percentile(gaps, 99) * 1e3,
    )


def drive(
    address: str, concurrency: int, items: list[TailRequest]
) -> tuple[list[Summary], dict[str, int]]:
    """Summaries per kind and overall, and the failed requests counted by reason."""
    with GatewayClient(address) as client, ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        outcomes = list(pool.map(lambda item: _send(client, item), items))
        elapsed = time.perf_counter() - start
    rows = [
        summarize(kind, concurrency, [o for o in outcomes if o.kind == kind], elapsed)
        for kind in KINDS
    ]
    failures = collections.Counter(o.failed for o in outcomes if o.failed)
    return [*rows, summarize("all", concurrency, outcomes, elapsed)], dict(failures)


def language_args(given: list[str]) -> tuple[str, ...]:
    """``given``, plus a stream capacity for the highest concurrency unless it sets one."""
    if any(a.split("=", 1)[0] == "--grpc-workers" for a in given):
        return tuple(given)
    return (f"--grpc-workers={max(CONCURRENCY)}", *given)


def _start(args: argparse.Namespace, model_dir: Path, log_dir: Path):
    """The stack, each worker with its role's extra flags."""
    stack = start_local_stack(
        model_dir,
        log_dir,
        num_encoders=0,
        num_languages=0,
        gateway_args=tuple(args.gateway_arg),
        startup_timeout_s=STARTUP_S,
    )
    try:
        stack.start_worker("encoder", tuple(args.encoder_arg), timeout_s=STARTUP_S)
        stack.start_worker("language", language_args(args.language_arg), timeout_s=STARTUP_S)
        stack.wait_registered(STARTUP_S)
    except BaseException:
        stack.stop()
        raise
    return stack


def bench(args: argparse.Namespace) -> dict:
    model_dir = Path(args.model_path or ensure_tiny_model("qwen2_5_vl", args.size))
    counts = QUICK_REQUESTS if args.quick else NUM_REQUESTS
    repeated = repeated_requests()
    rows: list[Summary] = []
    failures: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory(prefix="epd-bench-tail-") as log_dir:
        stack = _start(args, model_dir, Path(log_dir))
        with stack.serving():
            with GatewayClient(stack.gateway.address) as client:  # warm-up; caches the repeats
                for item in workload(len(KINDS), 999, repeated)[:-1]:
                    stream_one(client, item.request)
                for req in repeated:
                    stream_one(client, req)
            for c in CONCURRENCY:
                summaries, failures[str(c)] = drive(
                    stack.gateway.address, c, workload(counts[c], c, repeated)
                )
                rows += summaries
    overall = next(r for r in rows if r.kind == "all" and r.concurrency == 16)
    ratio = overall.ttft_p99_ms / overall.ttft_p50_ms if overall.ttft_p50_ms else float("inf")
    return {
        "model": model_dir.name,
        "server_args": {
            "gateway": args.gateway_arg,
            "encoder": args.encoder_arg,
            "language": list(language_args(args.language_arg)),
        },
        "rows": [asdict(r) for r in rows],
        "failures": failures,
        "ttft_p99_over_p50_at_16": ratio,
        "goal_met": ratio <= GOAL_P99_OVER_P50,
    }


def format_table(result: dict) -> str:
    extra = " ".join(f"{role}: {' '.join(a)}" for role, a in result["server_args"].items() if a)
    lines = [f"tail latency, mixed workload - {result['model']}{', ' + extra if extra else ''}"]
    head = f"{'conc':>5} {'kind':<9}{'reqs':>5}{'fail':>5}{'req/s':>8}"
    head += f"{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}  (ms)"
    lines.append(head)
    for r in result["rows"]:
        lines.append(
            f"{r['concurrency']:>5} {r['kind']:<9}{r['num_requests']:>5}{r['num_failed']:>5}"
            f"{r['requests_per_s']:>8.2f}{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>10.1f}"
            f"{r['itl_p50_ms']:>9.1f}{r['itl_p99_ms']:>9.1f}"
        )
    for c, reasons in result["failures"].items():
        for reason, num in reasons.items():
            lines.append(f"failed at concurrency {c}: {num} x {reason}")
    ratio = result["ttft_p99_over_p50_at_16"]
    lines.append(
        f"TTFT p99 / p50 at concurrency 16: {ratio:.2f}x (goal <= {GOAL_P99_OVER_P50:.0f}x): "
        f"{'met' if result['goal_met'] else 'not met'}"
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="half the requests")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--size", choices=("demo", "bench"), default="demo")
    parser.add_argument("--model-path", type=Path, help="checkpoint (default: generated, --size)")
    for role in ("language", "encoder", "gateway"):
        parser.add_argument(
            f"--{role}-arg",
            action="append",
            default=[],
            metavar="FLAG",
            help=f"extra flag for the {role} (repeatable; --{role}-arg=--flag=value)",
        )


def run(args: argparse.Namespace) -> int:
    result = bench(args)
    print(json.dumps(result) if args.json else format_table(result), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.tail", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
