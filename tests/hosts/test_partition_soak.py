"""Partition soak (slow): 1,000 mixed requests at concurrency 16 across hosts while a language
worker's host and then an encoder's host are each cut off for 10 s and restored.

Two encoders and two language workers behind one gateway, each on a host of its own. Mixed:
text only, a small image, and an image whose prompt is over twice the default transfer buffer
(continuations), all unary; and a small image with 64 tokens streamed. Printed: requests by
terminal status, time for each cut-off worker to leave routing and to rejoin after its link
returned, latency; at the end nothing is held anywhere.
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.channels import Keepalive
from services.gateway.client import GatewayClient
from tests.hosts.conftest import wait_until
from tests.hosts.partitions import Result, by_code, routed, seconds_until, send

NUM_REQUESTS = 1000
CONCURRENCY = 16
CUT_S = 10.0
TIMEOUT_S = 60.0
KINDS = ("text", "image", "stream", "long")


@pytest.mark.slow
def test_partition_soak(tiny_model_dir, host_stack_factory) -> None:
    stack = host_stack_factory(
        tiny_model_dir("qwen2_5_vl"),
        num_encoders=2,
        num_languages=2,
        env={"EPD_TRANSFER_DEFAULT_TOKENS": "256"},
    )
    results: list[Result] = []
    lock = threading.Lock()
    client = GatewayClient(stack.gateway_addresses, keepalive=Keepalive(2.0, 3.0))

    def one(i: int) -> None:
        result = send(client, KINDS[i % len(KINDS)], i, TIMEOUT_S)
        with lock:
            results.append(result)

    figures: list[str] = []

    def cut_for(proc, role: str) -> None:
        cut_at = time.monotonic()
        stack.cut(proc)
        gone_s = seconds_until(
            lambda: proc.address not in routed(stack, role), cut_at, 30, f"{proc.name} unrouted"
        )
        time.sleep(max(0.0, CUT_S - (time.monotonic() - cut_at)))
        stack.restore(proc)
        restored_at = time.monotonic()
        back_s = seconds_until(
            lambda: proc.address in routed(stack, role), restored_at, 60, f"{proc.name} back"
        )
        figures.append(f"{proc.name}: out of routing {gone_s:.1f} s after the cut, back "
                       f"{back_s:.1f} s after the link returned")  # fmt: skip

    start = time.monotonic()
    with client, ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(one, i) for i in range(NUM_REQUESTS)]
        wait_until(lambda: len(results) >= 150, 300, "150 requests done")
        cut_for(stack.languages[0], "language")
        wait_until(lambda: len(results) >= 500, 300, "500 requests done")
        cut_for(stack.encoders[0], "encoder")
        for future in futures:
            future.result(timeout=600)
    took_s = time.monotonic() - start
    latencies = sorted(r.ended_at - r.started_at for r in results)
    stack.wait_no_leaks(60)
    codes = by_code(results)
    by_kind = {k: by_code([r for r in results if r.kind == k]) for k in dict.fromkeys(KINDS)}
    print(f"\npartition soak: {len(results)} requests in {took_s:.0f} s at concurrency "
          f"{CONCURRENCY}: {codes}; by kind {by_kind}")  # fmt: skip
    print(f"latency p50 {statistics.median(latencies):.2f} s, p99 "
          f"{latencies[int(0.99 * len(latencies))]:.2f} s, max {latencies[-1]:.2f} s")  # fmt: skip
    for line in figures:
        print(line)
    print("leaks at the end: none")
    assert len(results) == NUM_REQUESTS  # every request ended, once
    assert set(codes) <= {"OK", "UNAVAILABLE"}, codes
    assert latencies[-1] < TIMEOUT_S + 5  # nothing hung until its deadline
    assert codes.get("OK", 0) >= 0.9 * NUM_REQUESTS
