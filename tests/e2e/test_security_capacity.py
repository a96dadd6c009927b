"""Health never waits behind work: with three times a server's stream capacity in flight, its
grpc.health.v1 check answers within a second every time, the streams beyond the capacity are
refused at once with RESOURCE_EXHAUSTED, and the admitted ones complete.

Real processes (``epd serve``), a language worker with 4 Generate streams and a gateway with
an admission bound of 4; long greedy answers (``ignore_eos``) keep the admitted streams busy
while the others arrive.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest

from common.channels import create_channel
from protos.epd.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    language_pb2,
    language_pb2_grpc,
)
from tests.e2e.conftest import Stack, start_stack

CAPACITY = 4
NUM_TOKENS = 1500  # long enough that the admitted streams outlive the refusals by far
HEALTH_BOUND_S = 1.0


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory) -> Iterator[Stack]:
    stack = start_stack(
        tiny_model_dir("qwen2_vl"),
        tmp_path_factory.mktemp("capacity"),
        gateway_args=("--max-queued", str(CAPACITY)),
        worker_args=("--grpc-workers", str(CAPACITY)),
    )
    yield stack
    stack.stop()


# A probe in a process of its own, as a kubelet is: checks health every 50 ms until its stdin
# closes, printing one JSON line [seconds, status] per check.
PROBE = """
import json, select, sys, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(sys.argv[1]))
while not select.select([sys.stdin], [], [], 0.05)[0]:
    start = time.monotonic()
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=float(sys.argv[2]))
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        status = f"{exc.code().name}: {exc.details()}"
    print(json.dumps([time.monotonic() - start, status]), flush=True)
"""


class HealthProbe:
    """Checks ``address``'s health every 50 ms from another process until ``stop()``."""

    def __init__(self, address: str) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", PROBE, address, str(HEALTH_BOUND_S)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.latencies: list[float] = []
        self.failures: list[str] = []

    def stop(self) -> None:
        out, _ = self._proc.communicate("stop\n", timeout=30)
        for line in out.splitlines():
            seconds, status = json.loads(line)
            self.latencies.append(seconds)
            if status != "SERVING":
                self.failures.append(status)


def flood(start_stream: Callable[[int], grpc.Call], address: str) -> dict:
    """CAPACITY streams admitted (each has sent its first chunk), then 2 x CAPACITY more while
    they run; returns what happened, with the health probe's record."""
    probe = HealthProbe(address)
    time.sleep(0.3)  # a few probes before the load
    try:
        admitted = [start_stream(i) for i in range(CAPACITY)]
        firsts = [next(call) for call in admitted]

        def excess(i: int) -> tuple[str, str, float]:
            try:
                list(start_stream(CAPACITY + i))
                return "OK", "", time.monotonic()
            except grpc.RpcError as exc:
                return exc.code().name, exc.details(), time.monotonic()

        with futures.ThreadPoolExecutor(2 * CAPACITY) as pool:
            refused = list(pool.map(excess, range(2 * CAPACITY), timeout=60))
        answers = []
        for first, call in zip(firsts, admitted, strict=True):
            chunks = [first, *call]
            answers.append((chunks, time.monotonic()))
        time.sleep(0.3)  # a few more probes after the load
    finally:
        probe.stop()
    return {"refused": refused, "answers": answers, "probe": probe}


def check(result: dict, message: str) -> None:
    probe: HealthProbe = result["probe"]
    assert probe.failures == []
    assert len(probe.latencies) >= 5 and max(probe.latencies) < HEALTH_BOUND_S
    assert [(code, details) for code, details, _ in result["refused"]] == [
        ("RESOURCE_EXHAUSTED", message)
    ] * (2 * CAPACITY)
    for chunks, _ in result["answers"]:
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert sum(len(c.token_ids) for c in chunks) == NUM_TOKENS
    last_refusal = max(at for _, _, at in result["refused"])
    assert last_refusal < min(at for _, at in result["answers"])  # refused while they ran


def messages(i: int) -> list[common_pb2.ChatMessage]:
    text = common_pb2.ContentPart(text=f"Count to a thousand, run {i}.")
    return [common_pb2.ChatMessage(role="user", content=[text])]


SAMPLING = common_pb2.SamplingParams(max_new_tokens=NUM_TOKENS, ignore_eos=True)


def test_language_worker_health_answers_while_excess_streams_are_refused(stack: Stack) -> None:
    address = stack.languages[0].address
    with create_channel(address) as channel:
        stub = language_pb2_grpc.LanguageServiceStub(channel)

        def start_stream(i: int):
            request = language_pb2.LanguageGenerateRequest(
                request_id=f"capacity-{i}", messages=messages(i), sampling=SAMPLING
            )
            return stub.Generate(request, timeout=300)

        result = flood(start_stream, address)
    check(result, f"language worker at its stream capacity {CAPACITY}: retry later or elsewhere")


def test_gateway_health_answers_while_excess_streams_are_refused(stack: Stack) -> None:
    address = stack.gateway.address
    with create_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def start_stream(i: int):
            request = gateway_pb2.GenerateRequest(messages=messages(i), sampling=SAMPLING)
            return stub.Generate(request, timeout=300)

        result = flood(start_stream, address)
    check(result, f"gateway queue is full ({CAPACITY} requests in flight)")  # admission's words
