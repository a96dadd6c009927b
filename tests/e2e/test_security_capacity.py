"""Health never waits behind work: with three times a server's stream capacity in flight, its
grpc.health.v1 check answers within a second every time, the streams beyond the capacity are
refused at once with RESOURCE_EXHAUSTED, and the admitted ones complete.

Real processes (``epd serve``), a language worker with 4 Generate streams and a gateway with
an admission bound of 4; long greedy answers (``ignore_eos``) keep the admitted streams busy
while the others arrive.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

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


@dataclass
class HealthProbe:
    """Checks ``address``'s health every 50 ms on a channel of its own, as a kubelet would."""

    address: str
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        with create_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self._stop.wait(0.05):
                start = time.monotonic()
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_BOUND_S)
                    if reply.status != health_pb2.HealthCheckResponse.SERVING:
                        self.failures.append(str(reply.status))
                except grpc.RpcError as exc:
                    self.failures.append(f"{exc.code().name}: {exc.details()}")
                self.latencies.append(time.monotonic() - start)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def flood(start_stream: Callable[[int], grpc.Call], address: str) -> dict:
    """CAPACITY streams admitted (each has sent its first chunk), then 2 x CAPACITY more while
    they run; returns what happened, with the health probe's record."""
    probe = HealthProbe(address)
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


def check(result: dict, who: str) -> None:
    probe: HealthProbe = result["probe"]
    assert probe.failures == []
    assert len(probe.latencies) >= 5 and max(probe.latencies) < HEALTH_BOUND_S
    message = f"{who} at its stream capacity {CAPACITY}: retry later or elsewhere"
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
    check(result, "language worker")


def test_gateway_health_answers_while_excess_streams_are_refused(stack: Stack) -> None:
    address = stack.gateway.address
    with create_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def start_stream(i: int):
            request = gateway_pb2.GenerateRequest(messages=messages(i), sampling=SAMPLING)
            return stub.Generate(request, timeout=300)

        result = flood(start_stream, address)
    check(result, "gateway")
