"""End to end through the gateway vs transformers' monolithic model, same checkpoint and run.

Starts a gateway, one encoder and one language worker as processes on 127.0.0.1 (the demo
checkpoint, or with ``--size bench`` one with Qwen2.5-VL-3B's layer widths and 4+4 layers),
drives the gateway at concurrency 1, 4 and 16 with a mixed image workload (text only, one small
image, one medium image; every image distinct, so no embedding-cache hits) and reports
requests/s, TTFT p50/p99 and inter-token latency p50. Two monolithic baselines run the same
kind of requests through ``HFReference``: one after the other (``generate`` per request, as a
server without batching would), and in static batches of 16 (``bench.static_batch``: left
padding to the longest prompt, one greedy ``generate`` per batch; the fair peer of a batching
monolithic server, which answers a batch when its longest request ends). The gateway's own
overhead is the p50 difference between the same text-only request sent through the gateway and
straight to the language worker's ``Generate`` RPC, alternating.

``epd bench e2e [--json] [--quick] [--size demo|bench]`` or ``python -m bench.e2e``.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from bench.static_batch import generate_batch
from common.models.hf_reference import HFReference
from common.models.tiny import ensure_tiny_model
from protos.epd.v1 import common_pb2, language_pb2, language_pb2_grpc
from services.gateway.client import GatewayClient
from services.gateway.workers import create_channel
from services.local_stack import LocalStack, start_local_stack

CONCURRENCY = (1, 4, 16)
NUM_REQUESTS = {1: 16, 4: 32, 16: 48}
MAX_TOKENS = 16
OVERHEAD_ROUNDS = 50
STARTUP_S = 180.0
STATIC_BATCH = 16


@dataclass
class Request:
    prompt: str
    images: list[Image.Image]
    payloads: list[bytes]


@dataclass
class Row:
    name: str
    concurrency: int
    num_requests: int
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    speedup: float = 0.0  # requests/s over the sequential monolithic baseline
    vs_static: float = 0.0  # requests/s over the static-batch monolithic baseline


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def workload(num: int, seed: int) -> list[Request]:
    """A third each: text only, one 224 px image, one 448x336 image; every image distinct."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        sizes = ((), ((224, 224),), ((448, 336),))[i % 3]
        images = [
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes
        ]
        prompt = f"Request {seed}-{i}: describe what you see in a few words."
        out.append(Request(prompt, images, [png(im) for im in images]))
    return out


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


# ---- the stack -----------------------------------------------------------------------------


# ---- measurements ---------------------------------------------------------------------------


def stream_one(client: GatewayClient, req: Request) -> tuple[float, list[float], int]:
    """(TTFT seconds, inter-token gaps, tokens) of one streamed request."""
    start = time.perf_counter()
    ttft, last, gaps, tokens = 0.0, 0.0, [], 0
    for chunk in client.generate_stream(
        req.prompt, req.payloads, timeout=300, max_tokens=MAX_TOKENS
    ):
        if not chunk.token_ids:
            continue
        now = time.perf_counter()
        if not ttft:
            ttft = now - start
        else:
            gaps.append((now - last) / len(chunk.token_ids))
        last, tokens = now, tokens + len(chunk.token_ids)
    return ttft, gaps, tokens


def drive_gateway(address: str, concurrency: int, requests: list[Request]) -> Row:
    with GatewayClient(address) as client, ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        results = list(pool.map(lambda r: stream_one(client, r), requests))
        elapsed = time.perf_counter() - start
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    return Row(
        "gateway",
        concurrency,
        len(requests),
        len(requests) / elapsed,
        percentile(ttfts, 50) * 1e3,
        percentile(ttfts, 99) * 1e3,
        percentile(gaps, 50) * 1e3,
    )


def drive_monolithic(ref: HFReference, requests: list[Request]) -> Row:
    """Sequential ``generate`` per request; TTFT is a 1-token generate of the same inputs."""
    ref.generate(ref.build_inputs("warm up", []), 2)
    start = time.perf_counter()
    ttfts, itls = [], []
    for req in requests:
        t0 = time.perf_counter()
        inputs = ref.build_inputs(req.prompt, req.images)
        tokens = ref.generate(inputs, MAX_TOKENS)
        total = time.perf_counter() - t0
        ttfts.append(total)  # the whole answer arrives at once without streaming
        itls.append(total / max(len(tokens), 1))
    elapsed = time.perf_counter() - start
    return Row(
        "transformers",
        1,
        len(requests),
        len(requests) / elapsed,
        percentile(ttfts, 50) * 1e3,
        percentile(ttfts, 99) * 1e3,
        percentile(itls, 50) * 1e3,
    )


def drive_static(ref: HFReference, requests: list[Request], batch_size: int) -> Row:
    """Static batches of ``batch_size``: every request of a batch is answered when the batch
    ends, so its TTFT is the batch's time since the run started waiting on it (all requests
    are there at the start, as at concurrency >= the batch size)."""
    generate_batch(ref, [ref.build_inputs("warm up", [])] * 2, 2)
    start = time.perf_counter()
    ttfts, itls = [], []
    for first in range(0, len(requests), batch_size):
        t0 = time.perf_counter()
        batch = requests[first : first + batch_size]
        inputs = [ref.build_inputs(req.prompt, req.images) for req in batch]
        tokens = generate_batch(ref, inputs, MAX_TOKENS)
        now = time.perf_counter()
        ttfts += [now - start] * len(batch)
        itls += [(now - t0) / max(len(t), 1) for t in tokens]
    elapsed = time.perf_counter() - start
    return Row(
        f"hf static {batch_size}",
        batch_size,
        len(requests),
        len(requests) / elapsed,
        percentile(ttfts, 50) * 1e3,
        percentile(ttfts, 99) * 1e3,
        percentile(itls, 50) * 1e3,
    )


def gateway_overhead_ms(stack: LocalStack, rounds: int) -> dict[str, float]:
    """p50 latency of one text-only request via the gateway and direct, alternating."""
    prompt, tokens = "Say hello.", 4
    message = common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text=prompt)])
    sampling = common_pb2.SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    via, direct = [], []
    with (
        GatewayClient(stack.gateway.address) as client,
        create_channel(stack.languages[0].address) as channel,
    ):
        stub = language_pb2_grpc.LanguageServiceStub(channel)
        for i in range(rounds + 2):  # the first two warm both paths up
            start = time.perf_counter()
            n = sum(
                len(c.token_ids)
                for c in client.generate_stream(
                    prompt, timeout=30, max_tokens=tokens, ignore_eos=True
                )
            )
            mid = time.perf_counter()
            request = language_pb2.LanguageGenerateRequest(
                request_id=uuid.uuid4().hex, messages=[message], sampling=sampling
            )
            m = sum(len(c.token_ids) for c in stub.Generate(request, timeout=30))
            end = time.perf_counter()
            assert n == m == tokens, (n, m)
            if i >= 2:
                via.append(mid - start)
                direct.append(end - mid)
    return {
        "gateway_p50_ms": statistics.median(via) * 1e3,
        "direct_p50_ms": statistics.median(direct) * 1e3,
        "overhead_p50_ms": (statistics.median(via) - statistics.median(direct)) * 1e3,
        "rounds": rounds,
    }


# ---- the command ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a third of the requests")
    parser.add_argument("--model-path", type=Path, help="checkpoint (default: generated, --size)")
    parser.add_argument(
        "--size",
        choices=("demo", "bench"),
        default="demo",
        help="generated Qwen2.5-VL checkpoint: demo, or bench (Qwen2.5-VL-3B widths, 4+4 layers)",
    )
    parser.add_argument("--overhead-rounds", type=int, default=OVERHEAD_ROUNDS)


def bench(args: argparse.Namespace) -> dict:
    model_dir = args.model_path or ensure_tiny_model("qwen2_5_vl", args.size)
    scale = 3 if args.quick else 1
    with tempfile.TemporaryDirectory(prefix="epd-bench-e2e-") as log_dir:
        stack = start_local_stack(Path(model_dir), Path(log_dir), startup_timeout_s=STARTUP_S)
        with stack.serving():
            rows = []
            with GatewayClient(stack.gateway.address) as client:  # warm-up
                for req in workload(3, 999):
                    stream_one(client, req)
            for c in CONCURRENCY:
                rows.append(
                    drive_gateway(stack.gateway.address, c, workload(NUM_REQUESTS[c] // scale, c))
                )
            overhead = gateway_overhead_ms(stack, args.overhead_rounds)
    ref = HFReference(model_dir)  # after the stack is gone: it has the CPU to itself
    baseline = drive_monolithic(ref, workload(NUM_REQUESTS[1] // scale, 1))
    static = drive_static(ref, workload(NUM_REQUESTS[16] // scale, 16), STATIC_BATCH)
    for row in rows:
        row.speedup = row.requests_per_s / baseline.requests_per_s
        row.vs_static = row.requests_per_s / static.requests_per_s
    static.speedup = static.requests_per_s / baseline.requests_per_s
    return {
        "model": str(model_dir),
        "max_new_tokens": MAX_TOKENS,
        "rows": [asdict(r) for r in rows],
        "baseline": asdict(baseline),
        "static_baseline": asdict(static),
        "speedup_at_16": rows[-1].speedup,
        "vs_static_at_16": rows[-1].vs_static,
        "gateway_overhead": overhead,
    }


def format_table(result: dict) -> str:
    head = f"{'path':<13}{'conc':>5}{'reqs':>6}{'req/s':>9}{'TTFT p50':>11}{'TTFT p99':>11}"
    head += f"{'ITL p50':>10}{'vs HF seq':>10}{'vs HF b16':>10}"
    lines = [f"model {result['model']}, {result['max_new_tokens']} new tokens per request", head]
    static = result.get("static_baseline")
    for r in [*result["rows"], result["baseline"], *([static] if static else [])]:
        seq = f"{r['speedup']:.2f}x" if r["speedup"] else "1.00x"
        b16 = f"{r['vs_static']:.2f}x" if r["vs_static"] else "-"
        if r is static:
            b16 = "1.00x"
        lines.append(
            f"{r['name']:<13}{r['concurrency']:>5}{r['num_requests']:>6}"
            f"{r['requests_per_s']:>9.2f}{r['ttft_p50_ms']:>8.1f} ms{r['ttft_p99_ms']:>8.1f} ms"
            f"{r['itl_p50_ms']:>7.2f} ms{seq:>10}{b16:>10}"
        )
    o = result["gateway_overhead"]
    lines.append(
        f"gateway overhead (text only, {o['rounds']} alternating rounds): p50 "
        f"{o['gateway_p50_ms']:.2f} ms via gateway vs {o['direct_p50_ms']:.2f} ms direct = "
        f"{o['overhead_p50_ms']:+.2f} ms (goal <= 1 ms)"
    )
    lines.append(
        f"requests/s at concurrency 16 vs transformers: {result['speedup_at_16']:.2f}x (goal >= 3x)"
    )
    if static:
        lines.append(
            f"requests/s at concurrency 16 vs transformers static batches of {STATIC_BATCH}: "
            f"{result['vs_static_at_16']:.2f}x"
        )
    lines.append("transformers: sequential generate, TTFT = whole answer (no streaming)")
    lines.append(
        f"hf static {STATIC_BATCH}: batches of {STATIC_BATCH}, left-padded, greedy; "
        "TTFT = when the request's batch ends"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = bench(args)
    print(json.dumps(result) if args.json else format_table(result), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.e2e", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
