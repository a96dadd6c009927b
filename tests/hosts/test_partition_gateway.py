"""One of two gateways' hosts cut off under load, then brought back.

A client that lists both gateways goes on: a request the cut gateway had not answered yet is
sent again to the other one (its channel's keepalive ends the call ``UNAVAILABLE``), one it was
streaming fails once; every request ends once within its deadline. The workers free what the
cut gateway's requests held (their servers' keepalive finds it gone), and when the link returns
the gateway lists every worker again (they kept heartbeating to it).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.channels import Keepalive
from services.gateway.client import GatewayClient
from tests.hosts.conftest import wait_until
from tests.hosts.partitions import Result, by_code, routed, send

ARCH = "qwen2_5_vl"
CONCURRENCY = 6
TIMEOUT_S = 30.0
CLIENT_KEEPALIVE = Keepalive(2.0, 3.0)


def test_gateway_host_cut_under_load(tiny_model_dir, host_stack_factory) -> None:
    stack = host_stack_factory(tiny_model_dir(ARCH), num_gateways=2)
    cut_gateway = stack.gateways[0]
    results: list[Result] = []
    lock = threading.Lock()
    stop = threading.Event()
    client = GatewayClient(stack.gateway_addresses, keepalive=CLIENT_KEEPALIVE)

    def worker(seed: int) -> None:
        n = 0
        while not stop.is_set():
            kind = ("text", "image")[(seed + n) % 2]
            result = send(client, kind, seed * 1000 + n, TIMEOUT_S)
            with lock:
                results.append(result)
            n += 1

    with client, ThreadPoolExecutor(CONCURRENCY) as pool:
        for i in range(CONCURRENCY):
            pool.submit(worker, i)
        wait_until(lambda: len(results) >= 20, 60, "load running")
        cut_at = time.monotonic()
        stack.cut(cut_gateway)
        wait_until(lambda: sum(r.started_at > cut_at + 6 for r in results) >= 20, 90, "load on")
        stack.restore(cut_gateway)
        restored_at = time.monotonic()
        registry = stack.registry_addresses[0]
        wait_until(
            lambda: (
                {p.address for p in stack.encoders + stack.languages}
                <= routed(stack, "encoder", registry) | routed(stack, "language", registry)
            ),
            30,
            "the gateway lists every worker again",
        )
        back_s = time.monotonic() - restored_at
        stop.set()
    during = [r for r in results if r.started_at >= cut_at and r.ended_at < restored_at]
    after_cut = [r for r in results if r.started_at > cut_at + 6]
    longest_s = max(r.ended_at - r.started_at for r in during)
    print(f"\ngateway host cut: {len(results)} requests, {by_code(results)}; started during "
          f"the cut: {by_code(during)}, the longest took {longest_s:.1f} s; the gateway listed "
          f"every worker {back_s:.1f} s after the link returned")  # fmt: skip
    assert all(r.ended_at - r.started_at < TIMEOUT_S + 5 for r in results)  # none hung
    assert all(r.code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE) for r in results), (
        by_code(results)
    )
    assert all(r.code == grpc.StatusCode.OK for r in after_cut), by_code(after_cut)
    stack.wait_no_leaks(60)  # the cut gateway's requests ended on the workers too
