"""Several gateways over the same workers, with real processes on 127.0.0.1.

Every worker registers with every gateway, so the gateways route from the same worker set:
encoder affinity (rendezvous hashing on the image) picks the same encoder whichever gateway a
request comes through. A gateway killed with SIGKILL under load takes only the streams it was
relaying: requests sent to the other gateway all succeed, the client with both addresses sends
a request that had not started streaming again to the other one, and the workers free
everything the dead gateway's requests held.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common.procs import free_port
from protos.epd.v1 import common_pb2
from services.gateway.client import GatewayClient
from tests.e2e.conftest import noise_image, png_bytes
from tests.e2e.test_faults import wait_for

ARCH = "qwen2_5_vl"
STREAM = {"max_tokens": 120, "ignore_eos": True}


@dataclass
class Timed:
    """One streamed request: when each chunk came, and how it ended."""

    chunk_times: list[float] = field(default_factory=list)  # when the client read each one
    tried: list[str] = field(default_factory=list)  # the gateways it was sent to, in order
    chunks: list = field(default_factory=list)  # gateway_pb2.GenerateChunk
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    finish_reason: int = 0
    future: Future | None = None


def timed_stream(
    client: GatewayClient, prompt: str, images: list[bytes], out: Timed, **sampling: object
) -> Timed:
    """Stream one request into ``out`` (``STREAM`` sampling unless given)."""
    stream = client.generate_stream(prompt, images, timeout=120, **(sampling or STREAM))
    try:
        for chunk in stream:
            out.chunk_times.append(time.monotonic())
            out.chunks.append(chunk)
            out.finish_reason = chunk.finish_reason or out.finish_reason
    except grpc.RpcError as exc:
        out.code, out.details = exc.code(), exc.details() or ""
    out.tried = stream.tried
    return out


def test_affinity_agrees_across_gateways(tiny_model_dir, stack_factory) -> None:
    stack = stack_factory(tiny_model_dir(ARCH), num_gateways=2, num_encoders=3)
    a, b = stack.gateway_addresses
    with GatewayClient(a) as via_a, GatewayClient(b) as via_b:
        for seed in range(6):
            image = png_bytes(noise_image(500 + seed, 112))
            first = via_a.generate("Which encoder?", [image], max_tokens=2, timeout=60)
            second = via_b.generate("Which encoder?", [image], max_tokens=2, timeout=60)
            assert first.encoder == second.encoder, seed
            assert second.timing.encoder_cache_hits == 1  # the embedding was cached there


def test_sigkill_a_gateway_under_load(tiny_model_dir, stack_factory) -> None:
    stack = stack_factory(
        tiny_model_dir(ARCH),
        num_gateways=2,
        num_encoders=2,
        num_languages=2,
        worker_args=("--grpc-workers", "48"),
    )
    a, b = stack.gateways
    only_b = GatewayClient(b.address)
    both = GatewayClient([a.address, b.address])  # a first: it serves until it dies
    small = png_bytes(noise_image(1, 112))
    with only_b, both, ThreadPoolExecutor(32) as pool:

        def send(client: GatewayClient, n: int, prefix: str, big: bool = False) -> list[Timed]:
            outs = []
            for i in range(n):
                images = [png_bytes(noise_image(700 + i, 448))] if big else [small] * (i % 2)
                out = Timed()
                out.future = pool.submit(timed_stream, client, f"{prefix} {i}", images, out)
                outs.append(out)
            return outs

        on_b = send(only_b, 8, "B")
        streaming = send(both, 8, "A")  # tokens flowing through a when it dies
        wait_for(lambda: sum(bool(o.chunk_times) for o in streaming) >= 4, 60, "a streaming")
        late = send(both, 8, "late", big=True)  # fresh 448x448 images: no token for a while
        a.kill(signal.SIGKILL)
        outcomes = {"on_b": on_b, "streaming": streaming, "late": late}
        for outs in outcomes.values():
            for out in outs:
                out.future.result(180)
    assert a.proc.wait(10) == -signal.SIGKILL
    for name, outs in outcomes.items():
        for out in outs:
            if out.code != grpc.StatusCode.OK:
                # only a request whose tokens had started to flow through a may fail
                # NOTE: not judged by when the client read its chunks: on a busy machine it
                # reads tokens that a sent before dying after the kill
                assert out.chunks and out.tried == [a.address], (name, out.tried, out.details)
                assert out.code == grpc.StatusCode.UNAVAILABLE, (name, out.code, out.details)
            else:
                assert out.finish_reason == common_pb2.FINISH_REASON_LENGTH, name
    assert all(out.code == grpc.StatusCode.OK for out in on_b)
    moved = [o for o in late if o.code == grpc.StatusCode.OK and o.tried == [a.address, b.address]]
    assert moved, "no request that had not started was sent again to the other gateway"

    # b still lists every worker, healthy; the workers hold nothing for a's requests
    want = {p.address for p in stack.encoders + stack.languages}
    listed = {w.address for w in stack.workers(stack.registry_addresses[1]) if w.healthy}
    assert listed == want
    stack.wait_no_leaks()
    with GatewayClient(b.address) as client:
        reply = client.generate("After", [small], max_tokens=4, timeout=60)
        assert reply.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_sigterm_a_gateway_drains_its_streams(tiny_model_dir, stack_factory) -> None:
    """A gateway's rollout: its streams run to their end, new requests move to the other
    gateway, and it exits by itself (status 0) within its drain timeout."""
    stack = stack_factory(
        tiny_model_dir(ARCH), num_gateways=2, gateway_args=("--drain-timeout-s", "60")
    )
    a, b = stack.gateways
    small = png_bytes(noise_image(2, 112))
    with GatewayClient(a.address) as only_a, GatewayClient([a.address, b.address]) as both:
        with ThreadPoolExecutor(16) as pool:
            streams = []
            for i in range(8):
                out = Timed()
                out.future = pool.submit(timed_stream, only_a, f"S {i}", [small] * (i % 2), out)
                streams.append(out)
            wait_for(lambda: all(o.chunk_times for o in streams), 60, "a streaming")
            sigterm_at = time.monotonic()
            a.kill(signal.SIGTERM)
            new = [
                pool.submit(both.generate, f"New {i}", [small] * (i % 2), max_tokens=4)
                for i in range(6)
            ]
            assert all(f.result(120).finish_reason == common_pb2.FINISH_REASON_LENGTH for f in new)
            for out in streams:
                out.future.result(120)
    assert [o.code for o in streams] == [grpc.StatusCode.OK] * len(streams)
    assert all(o.finish_reason == common_pb2.FINISH_REASON_LENGTH for o in streams)
    assert a.proc.wait(70) == 0
    assert time.monotonic() - sigterm_at < 60
    assert "drained in" in a.log_path.read_text(), a.tail()
    stack.wait_no_leaks()


def test_epd_run_starts_several_gateways(tiny_model_dir, tmp_path: Path) -> None:
    """``epd run --gateways 2``: each gateway's public and registry address is printed, the
    demo answers through them, and ``--once`` takes everything down."""
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", "--once", "--gateways", "2",
         "--languages", "2", "--gateway-port", str(port), "--log-dir", str(tmp_path),
         "--max-tokens", "4", "--model-path", str(tiny_model_dir(ARCH))],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    healthy = [line for line in out.splitlines() if line.strip().startswith("healthy   gateway")]
    assert len(healthy) == 2, out
    assert f"127.0.0.1:{port} (worker registry 127.0.0.1:" in healthy[0]
    registries = {line.split("worker registry ")[1] for line in healthy}
    assert len(registries) == 2
    assert sum(line.strip().startswith("healthy   language") for line in out.splitlines()) == 2
    assert "answer:" in out and "finish: length" in out
