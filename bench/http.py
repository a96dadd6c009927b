"""The HTTP front door against the gRPC one, same gateway, same request, same run.

Starts a gateway (with its HTTP port), one encoder and one language worker as processes on
127.0.0.1 and sends the same short text request (4 new tokens, EOS ignored) through both doors.
The checkpoint is the test-size one by default: what is measured is the doors' difference, and
the smaller the model's share of each request, the less its run-to-run noise hides it
(``--model-path`` takes another). The doors: ``POST /v1/chat/completions`` (a keep-alive
``http.client`` connection, the lightest Python client) and ``Gateway.GenerateUnary`` (one
long-lived gRPC channel). Latency: p50 and p99 of each, alternating request by request, unary
and streamed (time to ``[DONE]`` / to the last chunk), and refused at the door (a bad
temperature: the front door alone, no worker involved). Throughput: requests/s at concurrency 16
for each, measured twice in the order HTTP, gRPC, gRPC, HTTP so that drift favours neither.
Ratios are HTTP over gRPC; the goal is HTTP within 1 ms of gRPC at p50.

``python -m bench.http [--json] [--quick]``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import grpc

from common.models.tiny import ensure_tiny_model
from services.gateway.client import GatewayClient
from services.local_stack import LocalStack, start_local_stack

PROMPT = "Say hello."
MAX_TOKENS = 4
ROUNDS = 200
# unary and streamed answers; "refused": a bad request both doors turn away before admission,
# which times the front door alone (parsing, validation, the error answer), without a worker
KINDS = ("unary", "stream", "refused")
CONCURRENCY = 16
REQUESTS_PER_WORKER = 12
STARTUP_S = 180.0
BODY = {
    "messages": [{"role": "user", "content": PROMPT}],
    "max_tokens": MAX_TOKENS,
    "temperature": 0,
    "ignore_eos": True,
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class HttpDoor:
    """One keep-alive connection to the HTTP API."""

    def __init__(self, url: str) -> None:
        parts = urlparse(url)
        self._conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)

    def _post(self, body: dict) -> bytes:
        self._conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        reply = self._conn.getresponse()
        data = reply.read()
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {data[:300]!r}")
        return data

    def unary(self) -> None:
        answer = json.loads(self._post(BODY))
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS, answer

    def stream(self) -> None:
        data = self._post({**BODY, "stream": True})
        assert data.endswith(b"data: [DONE]\n\n"), data[-200:]

    def refused(self) -> None:
        try:
            self._post({**BODY, "temperature": -1})
        except RuntimeError as exc:
            assert "HTTP 400" in str(exc)
        else:
            raise AssertionError("a negative temperature was accepted")

    def close(self) -> None:
        self._conn.close()


class GrpcDoor:
    def __init__(self, client: GatewayClient) -> None:
        self._client = client

    def unary(self) -> None:
        reply = self._client.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=60)
        assert len(reply.token_ids) == MAX_TOKENS

    def stream(self) -> None:
        chunks = self._client.generate_stream(
            PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=60
        )
        assert sum(len(c.token_ids) for c in chunks) == MAX_TOKENS

    def refused(self) -> None:
        try:
            self._client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=-1, timeout=60)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        else:
            raise AssertionError("a negative temperature was accepted")


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def latency(http_door: HttpDoor, grpc_door: GrpcDoor, rounds: int) -> dict:
    """p50/p99 (ms) of each door, per kind of request, alternating; two warm-up rounds."""
    samples: dict[str, list[float]] = {}
    for i in range(rounds + 2):  # every round has every kind: load drift hits all alike
        for kind in KINDS:
            pair = (("http", http_door), ("grpc", grpc_door))
            for name, door in pair if i % 2 else reversed(pair):
                elapsed = _timed(getattr(door, kind))
                if i >= 2:
                    samples.setdefault(f"{name}_{kind}", []).append(elapsed * 1e3)
    out = {}
    for kind in KINDS:
        h, g = samples[f"http_{kind}"], samples[f"grpc_{kind}"]
        out[kind] = {
            "http_p50_ms": statistics.median(h),
            "grpc_p50_ms": statistics.median(g),
            "http_p99_ms": percentile(h, 99),
            "grpc_p99_ms": percentile(g, 99),
            "added_p50_ms": statistics.median(h) - statistics.median(g),
            "added_p99_ms": percentile(h, 99) - percentile(g, 99),
        }
    return out


def throughput(make_door: Callable[[], object], concurrency: int, per_worker: int) -> float:
    """Requests/s of ``concurrency`` workers each sending ``per_worker`` unary requests."""
    ready = threading.Barrier(concurrency + 1)

    def worker() -> None:
        door = make_door()
        door.unary()  # warm its connection up before the clock starts
        ready.wait()
        for _ in range(per_worker):
            door.unary()
        if isinstance(door, HttpDoor):
            door.close()

    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(worker) for _ in range(concurrency)]
        ready.wait()
        start = time.perf_counter()
        for f in futures:
            f.result()
        elapsed = time.perf_counter() - start
    return concurrency * per_worker / elapsed


def bench(args: argparse.Namespace) -> dict:
    model_dir = Path(args.model_path or ensure_tiny_model("qwen2_5_vl", "test"))
    rounds = ROUNDS // 3 if args.quick else ROUNDS
    per_worker = REQUESTS_PER_WORKER // 3 if args.quick else REQUESTS_PER_WORKER
    with tempfile.TemporaryDirectory(prefix="epd-bench-http-") as log_dir:
        stack: LocalStack = start_local_stack(
            model_dir, Path(log_dir), http_port=0, startup_timeout_s=STARTUP_S
        )
        with stack.serving():
            with GatewayClient(stack.gateway.address) as client:
                http_door, grpc_door = HttpDoor(stack.http_url), GrpcDoor(client)
                lat = latency(http_door, grpc_door, rounds)
                http_door.close()
                rates: dict[str, list[float]] = {"http": [], "grpc": []}
                for name in ("http", "grpc", "grpc", "http"):
                    make = (
                        (lambda: HttpDoor(stack.http_url))
                        if name == "http"
                        else (lambda: GrpcDoor(client))
                    )
                    rates[name].append(throughput(make, CONCURRENCY, per_worker))
    http_rps, grpc_rps = statistics.mean(rates["http"]), statistics.mean(rates["grpc"])
    return {
        "model": str(model_dir),
        "max_new_tokens": MAX_TOKENS,
        "rounds": rounds,
        "latency": lat,
        "concurrency": CONCURRENCY,
        "http_requests_per_s": http_rps,
        "grpc_requests_per_s": grpc_rps,
        "throughput_ratio": http_rps / grpc_rps,
    }


def format_table(result: dict) -> str:
    lines = [
        f"model {result['model']}, {result['max_new_tokens']} new tokens per request, "
        f"{result['rounds']} alternating rounds",
        f"{'request':<9}{'HTTP p50':>12}{'gRPC p50':>12}{'added':>11}{'HTTP p99':>12}"
        f"{'gRPC p99':>12}{'added':>11}{'ratio p50':>11}",
    ]
    for kind, row in result["latency"].items():
        lines.append(
            f"{kind:<9}{row['http_p50_ms']:>9.2f} ms{row['grpc_p50_ms']:>9.2f} ms"
            f"{row['added_p50_ms']:>+8.2f} ms{row['http_p99_ms']:>9.2f} ms"
            f"{row['grpc_p99_ms']:>9.2f} ms{row['added_p99_ms']:>+8.2f} ms"
            f"{row['http_p50_ms'] / row['grpc_p50_ms']:>10.2f}x"
        )
    lines.append(
        f"throughput at concurrency {result['concurrency']}: HTTP "
        f"{result['http_requests_per_s']:.1f} req/s vs gRPC {result['grpc_requests_per_s']:.1f} "
        f"req/s = {result['throughput_ratio']:.2f}x"
    )
    added = result["latency"]["unary"]["added_p50_ms"]
    lines.append(f"HTTP added latency p50 (unary): {added:+.2f} ms (goal <= 1 ms)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a third of the requests")
    parser.add_argument("--model-path", type=Path, help="checkpoint (default: the test-size one)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.http", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    result = bench(args)
    print(json.dumps(result) if args.json else format_table(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
