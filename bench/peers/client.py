"""One async streaming OpenAI chat client that drives any base URL, ours or vLLM's.

``run_requests(base_url, bodies, concurrency)`` keeps ``concurrency`` requests in flight
(``POST /v1/chat/completions`` with ``stream: true``) until every body is sent, and times each:
TTFT (to the first chunk with text), the gaps between chunks with text, end to end, and the
tokens (``usage.completion_tokens`` of the last chunk; the number of text chunks without it).
A chunk may carry several tokens: the gaps are then spread evenly over the tokens after the
first, so that an inter-token latency is per token whichever way a server groups them. A
request that fails — an HTTP error, a broken stream, an error event, no ``[DONE]``, no tokens —
is kept as a failure with its reason, never dropped.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from common.heap import freeze_startup_heap

PATH = "/v1/chat/completions"
DONE = "[DONE]"
TIMEOUT_S = 900.0


@dataclass
class RequestResult:
    ok: bool
    start: float  # perf_counter seconds
    end: float
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # per token, after the first
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""

    @property
    def e2e_s(self) -> float:
        return self.end - self.start

    @property
    def tpot_s(self) -> float:
        """The request's mean inter-token latency (last text chunk - first) / (tokens - 1):
        aiperf's "inter token latency"; 0.0 with fewer than two text chunks."""
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else 0.0


@dataclass
class RunResult:
    results: list[RequestResult]
    wall_s: float  # first request sent to last one finished
    concurrency: int


def per_token_gaps(times: Sequence[float], tokens: int) -> list[float]:
    """Inter-token latencies from the arrival ``times`` of the chunks with text and the
    request's ``tokens``: the gaps between chunks, each divided by the tokens it stands for on
    average when chunks carry several tokens."""
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    if len(times) > 1 and tokens > len(times):
        scale = (len(times) - 1) / (tokens - 1)
        gaps = [g * scale for g in gaps]
    return gaps


def _text_of(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    delta = choices[0].get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or ""


def _failed(start: float, why: str) -> RequestResult:
    return RequestResult(False, start, time.perf_counter(), error=why[:300])


async def stream_one(
    client: httpx.AsyncClient, body: bytes, timeout_s: float = TIMEOUT_S
) -> RequestResult:
    """Send one serialized streamed request and time its answer."""
    start = time.perf_counter()
    times: list[float] = []
    usage: dict | None = None
    done = False
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    try:
        async with client.stream(
            "POST", PATH, content=body, headers=headers, timeout=timeout_s
        ) as reply:
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")[:300]
                return _failed(start, f"HTTP {reply.status_code}: {text}")
            async for line in reply.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == DONE:
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"error event: {json.dumps(chunk['error'])[:300]}")
                if _text_of(chunk):
                    times.append(time.perf_counter())
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except Exception as exc:  # any failure is a counted, reported result
        return _failed(start, f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    tokens = int(usage["completion_tokens"]) if usage else len(times)
    prompt_tokens = int(usage.get("prompt_tokens") or 0) if usage else 0
    if not done or not times or tokens <= 0:
        why = "no [DONE]" if not done else "no tokens"
        return RequestResult(False, start, end, output_tokens=tokens, error=why)
    return RequestResult(
        True,
        start,
        end,
        ttft_s=times[0] - start,
        itl_s=per_token_gaps(times, tokens),
        output_tokens=tokens,
        prompt_tokens=prompt_tokens,
    )


def make_client(
    base_url: str, concurrency: int, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """One connection pool of ``concurrency`` keep-alive connections; no proxies from the
    environment (both servers are on 127.0.0.1). ``transport``: a stand-in server (tests)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(
        base_url=base_url, limits=limits, trust_env=False, timeout=TIMEOUT_S, transport=transport
    )


async def run_requests_async(
    base_url: str,
    bodies: Sequence[bytes],
    concurrency: int,
    timeout_s: float = TIMEOUT_S,
    transport: httpx.AsyncBaseTransport | None = None,
) -> RunResult:
    """Every body sent with ``concurrency`` in flight; results in the bodies' order."""
    results: list[RequestResult | None] = [None] * len(bodies)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(bodies)):
        queue.put_nowait(i)

    async def worker(client: httpx.AsyncClient) -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results[i] = await stream_one(client, bodies[i], timeout_s)

    async with make_client(base_url, concurrency, transport) as client:
        # the client's own full collections (25-40 ms here) would read as either server's stalls
        freeze_startup_heap()
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(min(concurrency, len(bodies)))))
        wall = time.perf_counter() - start
    done = [r for r in results if r is not None]
    return RunResult(done, wall, concurrency)


def run_requests(
    base_url: str, bodies: Sequence[bytes], concurrency: int, timeout_s: float = TIMEOUT_S
) -> RunResult:
    """``run_requests_async`` from synchronous code (its own event loop)."""
    return asyncio.run(run_requests_async(base_url, bodies, concurrency, timeout_s))


def served_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model ``GET /v1/models`` lists (both servers serve exactly one)."""
    with httpx.Client(base_url=base_url, trust_env=False, timeout=timeout_s) as client:
        reply = client.get("/v1/models")
        reply.raise_for_status()
        return reply.json()["data"][0]["id"]
