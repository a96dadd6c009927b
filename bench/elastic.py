"""Elastic operation on real processes: gateway scale-out, and rolling restarts under load.

One stack on 127.0.0.1 (the demo checkpoint): two gateways in front of the same encoders and
language workers, every worker registered with both.

1. Requests/s at concurrency 32 through one gateway vs both gateways (half the clients on each),
   side by side in one run: the two set-ups alternate for a few rounds per workload and the
   median of each is reported, so drift on a shared machine hits both alike. The gateways' CPU
   time per request (from ``/proc``) says how many requests/s one gateway core can relay.
2. Failed requests during a scripted rolling restart of each pool under a steady load
   (concurrency ``--load-concurrency``, mixed text and image requests, clients that know every
   gateway, as a Service would): encoders, then language workers, one at a time like a
   RollingUpdate with maxSurge 1 — start a replacement, wait until every gateway lists it,
   SIGTERM the old one (it drains), wait until it exited; then each gateway in place (SIGTERM,
   it drains and exits, the same ports start again). Goal: 0 failed requests.

``python -m bench.elastic [--json] [--quick]``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from PIL import Image

from common.models.tiny import ensure_tiny_model
from common.procs import ServiceProcess
from protos.epd.v1 import common_pb2
from services.gateway.client import GatewayClient
from services.local_stack import LocalStack, start_local_stack

CONCURRENCY = 32
MAX_TOKENS = 8
STARTUP_S = 300.0


def png(seed: int, size: int = 224) -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@dataclass(frozen=True)
class Workload:
    name: str
    make: Callable[[int], tuple[str, list[bytes]]]  # request number -> (prompt, images)


WORKLOADS = (
    Workload("text", lambda i: (f"Question {i}: say something short.", [])),
    Workload("1 image 224px", lambda i: (f"Picture {i}: what is it?", [png(i)])),
)


def one(client: GatewayClient, prompt: str, images: list[bytes]) -> None:
    reply = client.generate(prompt, images, timeout=300, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert reply.finish_reason == common_pb2.FINISH_REASON_LENGTH, reply.finish_reason


# ---- 1. one gateway vs two ------------------------------------------------------------------


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of the processes ``pids`` so far (``/proc/PID/stat``)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of the line)
    return total / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Run:
    requests_per_s: float
    gateway_cpu_ms: float  # CPU time of all gateway processes per request


def drive(stack: LocalStack, gateways: list[str], workload: Workload, num: int, seed: int) -> Run:
    """``num`` requests at concurrency 32, spread evenly over ``gateways``."""
    clients = [GatewayClient(address) for address in gateways]
    pids = [g.proc.pid for g in stack.gateways]
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            cpu = cpu_seconds(pids)
            start = time.perf_counter()
            futures = [
                pool.submit(one, clients[i % len(clients)], *workload.make(seed + i))
                for i in range(num)
            ]
            for future in futures:
                future.result()
            elapsed = time.perf_counter() - start
            return Run(num / elapsed, (cpu_seconds(pids) - cpu) / num * 1e3)
    finally:
        for client in clients:
            client.close()


def scale_out(stack: LocalStack, rounds: int, num: int) -> list[dict]:
    rows = []
    both, first = stack.gateway_addresses, stack.gateway_addresses[:1]
    for w, workload in enumerate(WORKLOADS):
        drive(stack, both, workload, CONCURRENCY, 10_000_000 * (w + 1))  # warm-up
        one_gw: list[Run] = []
        two_gw: list[Run] = []
        for r in range(rounds):
            seed = 1_000_000 * (w + 1) + 2 * r * num
            one_gw.append(drive(stack, first, workload, num, seed))
            two_gw.append(drive(stack, both, workload, num, seed + num))
        one_rps = statistics.median(run.requests_per_s for run in one_gw)
        two_rps = statistics.median(run.requests_per_s for run in two_gw)
        rows.append(
            {
                "workload": workload.name,
                "num_requests": num,
                "rounds": rounds,
                "one_gateway_rps": one_rps,
                "two_gateways_rps": two_rps,
                "ratio": two_rps / one_rps,
                "gateway_cpu_ms_per_request": statistics.median(
                    run.gateway_cpu_ms for run in one_gw + two_gw
                ),
                "one_gateway_all": [run.requests_per_s for run in one_gw],
                "two_gateways_all": [run.requests_per_s for run in two_gw],
            }
        )
    return rows


# ---- 2. rolling restarts under load ---------------------------------------------------------


@dataclass
class Load:
    """A steady load of requests, each tagged with the phase it ended in."""

    stack: LocalStack
    concurrency: int
    phase: str = "warm-up"
    outcomes: list[tuple[str, str]] = field(default_factory=list)  # (phase, "OK" or error)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, worker_id: int) -> None:
        addresses = self.stack.gateway_addresses
        first = worker_id % len(addresses)
        with GatewayClient(addresses[first:] + addresses[:first]) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                seed = 1_000_000 * (worker_id + 1) + n
                images = [png(seed, 112)] if n % 2 else []
                try:
                    one(client, f"Steady {worker_id}.{n}", images)
                    result = "OK"
                except grpc.RpcError as exc:
                    result = f"{exc.code().name}: {exc.details()}"
                except AssertionError as exc:
                    result = f"bad finish: {exc}"
                with self._lock:
                    self.outcomes.append((self.phase, result))

    def stop(self) -> None:
        self._stop.set()


def replace_worker(stack: LocalStack, old: ServiceProcess, role: str, retired: list) -> float:
    """maxSurge 1: the replacement is registered everywhere before the old one gets SIGTERM;
    returns the seconds the old one took to drain and exit."""
    stack.start_worker(role, timeout_s=STARTUP_S)
    stack.wait_registered(STARTUP_S)
    group = stack.encoders if role == "encoder" else stack.languages
    group.remove(old)
    retired.append(old)
    start = time.monotonic()
    old.kill(signal.SIGTERM)
    old.proc.wait(STARTUP_S)
    return time.monotonic() - start


def rolling_restarts(stack: LocalStack, concurrency: int, settle_s: float) -> list[dict]:
    load = Load(stack, concurrency)
    retired: list[ServiceProcess] = []
    phases = []
    with ThreadPoolExecutor(concurrency) as pool:
        running = [pool.submit(load.run, i) for i in range(concurrency)]
        time.sleep(settle_s)
        try:
            for role in ("encoder", "language", "gateway"):
                load.phase = role
                start = time.monotonic()
                drains = []
                if role == "gateway":
                    for i in range(len(stack.gateways)):
                        t0 = time.monotonic()
                        stack.restart_gateway(i, STARTUP_S)
                        drains.append(time.monotonic() - t0)
                        time.sleep(settle_s)
                else:
                    group = stack.encoders if role == "encoder" else stack.languages
                    for old in list(group):
                        drains.append(replace_worker(stack, old, role, retired))
                        time.sleep(settle_s)
                phases.append(
                    {"pool": role, "seconds": time.monotonic() - start, "replaced": len(drains)}
                )
            load.phase = "after"
            time.sleep(settle_s)
        finally:
            load.stop()
            for future in running:
                future.result()
            for proc in retired:
                proc.stop()
    for row in phases:
        results = [r for p, r in load.outcomes if p == row["pool"]]
        failures = [r for r in results if r != "OK"]
        row.update(
            num_requests=len(results),
            num_failed=len(failures),
            failures=dict(Counter(failures).most_common(5)),
        )
    return phases


# ---- the command ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="fewer requests and rounds")
    parser.add_argument("--model-path", type=Path, help="checkpoint (default: the demo one)")
    parser.add_argument("--encoders", type=int, default=1)
    parser.add_argument("--languages", type=int, default=1)
    parser.add_argument("--load-concurrency", type=int, default=8)


def bench(args: argparse.Namespace) -> dict:
    model_dir = args.model_path or ensure_tiny_model("qwen2_5_vl", "demo")
    num, rounds = (64, 2) if args.quick else (128, 3)
    with tempfile.TemporaryDirectory(prefix="epd-bench-elastic-") as log_dir:
        stack = start_local_stack(
            Path(model_dir),
            Path(log_dir),
            args.encoders,
            args.languages,
            num_gateways=2,
            # the default encoder's 8 Encode calls at once would refuse a burst of 32
            worker_args=("--grpc-workers", str(2 * CONCURRENCY)),
            startup_timeout_s=STARTUP_S,
        )
        with stack.serving():
            scale = scale_out(stack, rounds, num)
            restarts = rolling_restarts(stack, args.load_concurrency, 2.0 if args.quick else 4.0)
    return {
        "model": str(model_dir),
        "pools": {"encoders": args.encoders, "languages": args.languages, "gateways": 2},
        "max_new_tokens": MAX_TOKENS,
        "concurrency": CONCURRENCY,
        "scale_out": scale,
        "rolling_restarts": restarts,
        "total_failed": sum(r["num_failed"] for r in restarts),
    }


def format_table(result: dict) -> str:
    pools = result["pools"]
    lines = [
        f"model {result['model']}, {pools['encoders']} encoders, {pools['languages']} language "
        f"workers, {result['max_new_tokens']} new tokens per request",
        f"requests/s at concurrency {result['concurrency']}, median of the rounds "
        "(1 and 2 gateways alternate):",
        f"{'workload':<16}{'reqs':>6}{'rounds':>8}{'1 gateway':>11}{'2 gateways':>12}{'ratio':>8}"
        f"{'gateway CPU/req':>17}",
    ]
    for r in result["scale_out"]:
        lines.append(
            f"{r['workload']:<16}{r['num_requests']:>6}{r['rounds']:>8}"
            f"{r['one_gateway_rps']:>11.2f}{r['two_gateways_rps']:>12.2f}{r['ratio']:>7.2f}x"
            f"{r['gateway_cpu_ms_per_request']:>14.2f} ms"
        )
    lines.append(
        f"(this host has {os.cpu_count()} cores for every process of the stack: a second gateway "
        "only adds throughput where the first one's core is the bottleneck)"
    )
    lines.append("rolling restart of each pool under steady load (goal: 0 failed):")
    lines.append(f"{'pool':<10}{'replaced':>9}{'seconds':>9}{'requests':>10}{'failed':>8}")
    for r in result["rolling_restarts"]:
        lines.append(
            f"{r['pool']:<10}{r['replaced']:>9}{r['seconds']:>9.1f}{r['num_requests']:>10}"
            f"{r['num_failed']:>8}"
        )
        for failure, count in r["failures"].items():
            lines.append(f"    {count} x {failure}")
    lines.append(f"failed requests in all: {result['total_failed']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = bench(args)
    print(json.dumps(result) if args.json else format_table(result), flush=True)
    return 0 if result["total_failed"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.elastic", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
