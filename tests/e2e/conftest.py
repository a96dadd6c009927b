"""A real stack for end-to-end tests: gateway, encoders and language workers as processes.

Everything runs on 127.0.0.1 with the real Mooncake engine over tcp, real ZMQ and real gRPC;
workers register with the gateway by heartbeat, exactly as in ``epd run``.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common.procs import ServiceProcess, free_port
from protos.epd.v1 import encoder_pb2, encoder_pb2_grpc, language_pb2, language_pb2_grpc
from services.gateway.client import GatewayClient
from services.gateway.workers import create_channel

STARTUP_S = 120.0
# Short transfer timeouts so fault tests finish quickly.
FAST_TRANSFER_ENV = {
    "EPD_TRANSFER_HEARTBEAT_INTERVAL_S": "0.2",
    "EPD_TRANSFER_HEARTBEAT_TIMEOUT_S": "2",
    "EPD_TRANSFER_BOOTSTRAP_TIMEOUT_S": "10",
    "EPD_TRANSFER_WAITING_TIMEOUT_S": "10",
    "EPD_TRANSFER_TRANSFER_TIMEOUT_S": "5",
    "MC_TRANSFER_TIMEOUT": "5",
}


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def noise_image(seed: int, width: int = 112, height: int | None = None) -> Image.Image:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height or width, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@dataclass
class Stack:
    gateway: ServiceProcess
    encoders: list[ServiceProcess]
    languages: list[ServiceProcess]
    procs: list[ServiceProcess] = field(default_factory=list)
    metrics_ports: dict[str, int] = field(default_factory=dict)

    def client(self) -> GatewayClient:
        return GatewayClient(self.gateway.address)

    def encoder_load(self, i: int = 0) -> encoder_pb2.LoadReport:
        with create_channel(self.encoders[i].address) as channel:
            stub = encoder_pb2_grpc.EncoderStub(channel)
            return stub.GetLoad(encoder_pb2.GetLoadRequest(), timeout=5)

    def language_load(self, i: int = 0) -> language_pb2.LanguageLoad:
        with create_channel(self.languages[i].address) as channel:
            stub = language_pb2_grpc.LanguageServiceStub(channel)
            return stub.GetLoad(language_pb2.LanguageLoadRequest(), timeout=5)

    def leaks(self) -> list[str]:
        """What is still held by live workers; [] when everything was freed."""
        import json

        found = []
        for i, proc in enumerate(self.encoders):
            if not proc.alive():
                continue
            load = self.encoder_load(i)
            stats = json.loads(load.sender_stats_json or "{}")
            if load.num_queued_requests or stats.get("num_used_blocks", 0):
                found.append(
                    f"{proc.name}: {load.num_queued_requests} rooms, "
                    f"{stats.get('num_used_blocks')} blocks"
                )
        for i, proc in enumerate(self.languages):
            if not proc.alive():
                continue
            load = self.language_load(i)
            busy = load.num_running + load.num_waiting + load.num_receiving
            slots_leaked = load.num_kv_slots_used - load.num_radix_tokens
            if busy or slots_leaked:
                found.append(
                    f"{proc.name}: {busy} requests, {slots_leaked} slots outside the radix cache"
                )
        return found

    def wait_no_leaks(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (leaks := self.leaks()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert leaks == [], leaks

    def wait_registered(self, timeout_s: float = STARTUP_S) -> None:
        want = {p.address for p in self.encoders + self.languages if p.alive()}
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while time.monotonic() < deadline:
                healthy = {w.address for w in client.list_workers() if w.healthy}
                if want <= healthy:
                    return
                time.sleep(0.1)
        raise TimeoutError(f"workers not registered: {want}")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def start_stack(
    model_dir: Path,
    log_dir: Path,
    num_encoders: int = 1,
    num_languages: int = 1,
    gateway_args: tuple[str, ...] = (),
    worker_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    metrics: bool = False,
) -> Stack:
    """Start and wait until every worker is registered. With ``metrics``, each process serves
    Prometheus metrics on a free port, recorded in ``Stack.metrics_ports`` by process name."""
    env = {**FAST_TRANSFER_ENV, **(env or {})}
    metrics_ports: dict[str, int] = {}

    def metrics_args(name: str) -> list[str]:
        if not metrics:
            return []
        metrics_ports[name] = free_port()
        return ["--metrics-port", str(metrics_ports[name])]

    port = free_port()
    gateway_cmd = ["serve", "gateway", "--port", str(port), "--worker-expiry-s", "3",
                   "--health-poll-s", "0.5", *metrics_args("gateway"), *gateway_args]  # fmt: skip
    gateway = ServiceProcess("gateway", gateway_cmd, f"127.0.0.1:{port}", log_dir, env)
    stack = Stack(gateway, [], [], [gateway], metrics_ports)
    for role, count, group in (
        ("encoder", num_encoders, stack.encoders),
        ("language", num_languages, stack.languages),
    ):
        for i in range(count):
            name, wport = f"{role}-{i}", free_port()
            cmd = ["serve", role, "--model-path", str(model_dir), "--port", str(wport),
                   "--gateway", gateway.address, "--heartbeat-interval-s", "0.5",
                   *metrics_args(name), *worker_args]  # fmt: skip
            proc = ServiceProcess(name, cmd, f"127.0.0.1:{wport}", log_dir, env)
            group.append(proc)
            stack.procs.append(proc)
    try:
        for proc in stack.procs:
            proc.wait_healthy(STARTUP_S)
        stack.wait_registered()
    except BaseException:
        stack.stop()
        raise
    return stack


@pytest.fixture
def stack_factory(tmp_path: Path):
    """``stack_factory(model_dir, **kw)`` starts a stack that is stopped after the test."""
    stacks: list[Stack] = []

    def make(model_dir: Path, **kwargs) -> Stack:
        stack = start_stack(model_dir, tmp_path, **kwargs)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.stop()
