"""A real stack for end-to-end tests: gateway, encoders and language workers as processes.

Everything runs on 127.0.0.1 with the real Mooncake engine over tcp, real ZMQ and real gRPC;
workers register with the gateway by heartbeat, exactly as in ``epd run``.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from protos.epd.v1 import encoder_pb2, encoder_pb2_grpc, language_pb2, language_pb2_grpc
from services.gateway.workers import create_channel
from services.local_stack import LocalStack, start_local_stack

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


class Stack(LocalStack):
    """A local stack plus what the tests inspect: workers' load reports and leaks."""

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
            if (
                load.num_queued_requests
                or stats.get("num_used_blocks", 0)
                or (load.queued_pixel_bytes)
            ):
                found.append(
                    f"{proc.name}: {load.num_queued_requests} rooms, "
                    f"{stats.get('num_used_blocks')} blocks, {load.queued_pixel_bytes} patch bytes"
                )
        for i, proc in enumerate(self.languages):
            if not proc.alive():
                continue
            load = self.language_load(i)
            busy = load.num_running + load.num_waiting + load.num_receiving
            slots_leaked = load.num_kv_slots_used - load.num_radix_tokens
            blocks_held = max(0, load.num_used_transfer_blocks)  # lent ones included
            locked = load.num_radix_locked_tokens
            if busy or slots_leaked or blocks_held or locked:
                found.append(
                    f"{proc.name}: {busy} requests, {slots_leaked} slots outside the radix cache, "
                    f"{blocks_held} transfer blocks, {locked} radix tokens locked"
                )
        return found

    def wait_no_leaks(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (leaks := self.leaks()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert leaks == [], leaks

    def wait_registered(self, timeout_s: float = STARTUP_S) -> None:
        super().wait_registered(timeout_s)


def start_stack(
    model_dir: Path,
    log_dir: Path,
    gateway_args: tuple[str, ...] = (),
    worker_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    **kwargs,
) -> Stack:
    """A stack with short expiry, heartbeat and transfer timeouts, so fault tests are quick."""
    return start_local_stack(
        model_dir,
        log_dir,
        gateway_args=("--worker-expiry-s", "3", "--health-poll-s", "0.5", *gateway_args),
        worker_args=("--heartbeat-interval-s", "0.5", *worker_args),
        env={**FAST_TRANSFER_ENV, **(env or {})},
        startup_timeout_s=STARTUP_S,
        stack_cls=Stack,
        **kwargs,
    )


STACKS = pytest.StashKey[list["Stack"]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test's report carries the log tails of the stacks it started (what CI shows)."""
    report = yield
    if report.when == "call" and report.failed:
        for stack in item.stash.get(STACKS, []):
            report.sections.append(("stack log tails", stack.log_tails()))
    return report


@pytest.fixture
def stack_factory(tmp_path: Path, request: pytest.FixtureRequest):
    """``stack_factory(model_dir, **kw)`` starts a stack that is stopped after the test."""
    stacks = request.node.stash.setdefault(STACKS, [])

    def make(model_dir: Path, **kwargs) -> Stack:
        stack = start_stack(model_dir, tmp_path, **kwargs)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.stop()
