"""What the partition tests share: streams run in the background, what each ended with, and
the figures they check (how long until a cut-off worker's streams end, until it leaves routing,
until it is back)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from protos.epd.v1 import gateway_pb2
from services.gateway.client import GatewayClient
from tests.hosts.conftest import HostStack, wait_until


@dataclass
class Outcome:
    """How one streamed request ended (exactly once: ``ended`` is set when it did)."""

    chunks: list[gateway_pb2.GenerateChunk] = field(default_factory=list)
    code: grpc.StatusCode | None = None
    details: str = ""
    ended_at: float = 0.0  # time.monotonic()
    first_chunk: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    call: Any = None  # the streaming call (``cancel()`` ends it)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def served_by(self) -> str:
        """The language worker that streamed it ("" before its first chunk)."""
        return next((c.language for c in self.chunks if c.language), "")


def consume(call, outcome: Outcome) -> Outcome:
    assert outcome.code is None, "a request ends once"
    try:
        for chunk in call:
            outcome.chunks.append(chunk)
            outcome.first_chunk.set()
        outcome.code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        outcome.code, outcome.details = exc.code(), exc.details() or ""
    outcome.ended_at = time.monotonic()
    outcome.first_chunk.set()
    outcome.ended.set()
    return outcome


def stream(
    pool: ThreadPoolExecutor, client: GatewayClient, prompt: str, images=(), **kw
) -> tuple[Outcome, Future]:
    call = client.generate_stream(prompt, list(images), **kw)
    outcome = Outcome(call=call)
    return outcome, pool.submit(consume, call, outcome)


def routed(stack: HostStack, role: str, registry: str | None = None) -> set[str]:
    """The workers of ``role`` a gateway routes to now (registered and healthy)."""
    try:
        workers = stack.workers(registry)
    except grpc.RpcError:
        return set()
    return {w.address for w in workers if w.role == role and w.healthy}


def seconds_until(condition: Callable[[], object], since: float, timeout_s: float, what: str):
    """Seconds from ``since`` until ``condition()`` held (polled every 0.1 s)."""
    wait_until(condition, timeout_s, what)
    return time.monotonic() - since


def running(stack: HostStack, index: int) -> int:
    return stack.language_load(index).num_running


def receiving(stack: HostStack, index: int) -> int:
    return stack.language_load(index).num_receiving


@dataclass
class Result:
    """One unary request of a load: how it ended and when."""

    kind: str
    code: grpc.StatusCode
    started_at: float
    ended_at: float
    details: str = ""
    encoder: str = ""
    language: str = ""


def send(client: GatewayClient, kind: str, seed: int, timeout_s: float) -> Result:
    """One request of ``kind`` through every gateway the client lists: ``text``, ``image``,
    ``long`` (an image whose prompt is several times the default transfer buffer), all unary,
    or ``stream`` (a small image, 64 tokens streamed)."""
    from tests.e2e.conftest import noise_image, png_bytes

    images = {
        "text": [],
        "image": [png_bytes(noise_image(seed, 112 + 28 * (seed % 4)))],
        "stream": [png_bytes(noise_image(seed, 112))],
        "long": [png_bytes(noise_image(seed, 672))],
    }[kind]
    started = time.monotonic()
    if kind == "stream":
        outcome = consume(
            client.generate_stream(f"Request {seed}: a story.", images, max_tokens=64,
                                   ignore_eos=True, timeout=timeout_s),
            Outcome(),
        )  # fmt: skip
        assert outcome.code is not None
        last = outcome.chunks[-1] if outcome.chunks else None
        return Result(kind, outcome.code, started, outcome.ended_at, outcome.details,
                      last.encoder if last else "", last.language if last else "")  # fmt: skip
    try:
        reply = client.generate(f"Request {seed}: describe.", images, max_tokens=8,
                                timeout=timeout_s)  # fmt: skip
    except grpc.RpcError as exc:
        return Result(kind, exc.code(), started, time.monotonic(), exc.details() or "")
    return Result(kind, grpc.StatusCode.OK, started, time.monotonic(), "", reply.encoder,
                  reply.language)  # fmt: skip


def by_code(results: list[Result]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.code.name] = counts.get(r.code.name, 0) + 1
    return counts
