"""The status page's data: the gateway's own view of the pools, sampled by a thread of its own.

``DashboardSampler`` wakes every ``sample_s`` (it waits on an Event in between) and records:
* one point of each time series, kept for ``history_s`` in a ring buffer: requests/s by API and
  errors/s (from ``GatewayMetrics.recent``, what finished since the last point), TTFT p50/p99 of
  the requests that finished OK meanwhile, transfer GB/s (the growth of the encoders'
  ``bytes_sent`` between two ``GetLoad`` replies), requests in flight;
* each worker's last ``GetLoad`` reply (queue depths, transfer blocks, KV slots, cache), beside
  what the registry knows (health, in-flight, problem). A worker that left the registry stays
  on the page as ``gone`` for ``history_s``, so a dead worker turns visibly unhealthy instead of
  vanishing.

``state(show_addresses)`` is the JSON of ``GET /dashboard/state``. Worker addresses are internal:
without ``show_addresses`` a worker is named by its role and a short hash of its address
(stable, so rows can be followed between refreshes) and nothing else names it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from protos.epd.v1 import encoder_pb2, language_pb2
from services.gateway.admission import Admission
from services.gateway.metrics import GatewayMetrics
from services.gateway.registry import ROLES, Role, Worker, WorkerRegistry
from services.gateway.routing import worker_problems

log = logging.getLogger(__name__)
POLL_TIMEOUT_S = 1.0
APIS = ("grpc", "http")


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def worker_id(address: str, role: str) -> str:
    """A worker's public name: its role and a short hash of its address."""
    return f"{role}-{hashlib.sha256(address.encode()).hexdigest()[:8]}"


@dataclass
class Seen:
    """What the page shows of one worker: the registry's view and its last GetLoad reply."""

    row: dict  # address included; stripped when addresses are not shown
    bytes_sent: int = -1  # encoder: its sender's lifetime bytes at the last reply
    gone_at: float = 0.0  # wall time it left the registry (0: still there)


def _get_load(worker: Worker):
    """The worker's GetLoad reply, or None when it does not answer."""
    if worker.stubs is None:
        return None
    request = (
        encoder_pb2.GetLoadRequest()
        if worker.role == Role.ENCODER
        else language_pb2.LanguageLoadRequest()
    )
    try:
        return worker.stubs.service.GetLoad(request, timeout=POLL_TIMEOUT_S)
    except (grpc.RpcError, ValueError):  # ValueError: its channel was closed meanwhile
        return None


def _row(worker: Worker, reply, problem: str, age_s: float) -> dict:
    figures = worker.load
    row = {
        "address": worker.address,
        "role": worker.role.value,
        "state": "healthy" if worker.healthy else "unhealthy",
        "in_flight": worker.in_flight,
        "capacity": worker.capacity,
        "last_seen_s": round(age_s, 1),
        "problem": problem,
        "model": worker.info.get("model", ""),
    }
    if worker.role == Role.ENCODER:
        row["queue"] = {
            "requests": figures.get("queue_depth", 0),
            "images": figures.get("queued_images", 0),
            "waiting_for_blocks": figures.get("waiting_for_blocks", 0),
        }
        stats = json.loads(reply.sender_stats_json or "{}") if reply is not None else {}
        used, free = stats.get("num_used_blocks"), stats.get("num_free_blocks")
        row["blocks"] = {"used": used, "total": used + free} if used is not None else None
        row["kv"] = None
        if reply is not None:
            cache = reply.cache
            row["cache"] = {"hits": cache.num_hits, "misses": cache.num_misses}
            row["video"] = {"frames": reply.num_video_frames, "decode_s": reply.video_decode_s}
    else:
        row["queue"] = {
            "running": figures.get("running", 0),
            "waiting": figures.get("waiting", 0),
            "receiving": figures.get("receiving", 0),
        }
        row["kv"] = {
            "used": figures.get("kv_slots_used", 0),
            "total": figures.get("kv_slots_total", 0),
        }
        blocks = None
        if reply is not None and reply.num_used_transfer_blocks >= 0:
            used = reply.num_used_transfer_blocks
            blocks = {"used": used, "total": used + reply.num_free_transfer_blocks}
        row["blocks"] = blocks
    return row


class DashboardSampler:
    def __init__(
        self,
        registry: WorkerRegistry,
        metrics: GatewayMetrics,
        admission: Admission,
        sample_s: float,
        history_s: float,
    ) -> None:
        self.sample_s = sample_s
        self.history_s = history_s
        self._registry = registry
        self._metrics = metrics
        self._admission = admission
        self._lock = threading.Lock()
        self._points: deque[dict] = deque(maxlen=max(2, round(history_s / sample_s)))
        self._seen: dict[str, Seen] = {}
        self._last = time.monotonic()
        self._started = time.time()
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="dashboard-poll")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dashboard-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # a defect here must not end the page's sampling
                log.exception("dashboard sample failed")
            if self._stop.wait(self.sample_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def sample(self) -> None:
        """Take one point now (the thread calls it every ``sample_s``)."""
        now, wall = time.monotonic(), time.time()
        dt = max(now - self._last, 1e-3)
        self._last = now
        tally = self._metrics.recent.take()
        workers = self._registry.all()
        replies = list(self._pool.map(_get_load, workers))
        problems = worker_problems(workers)
        num_bytes = 0
        with self._lock:
            present = set()
            for worker, reply in zip(workers, replies, strict=True):
                present.add(worker.address)
                age = self._registry.age_s(worker)
                row = _row(worker, reply, problems.get(worker.address, ""), age)
                seen = self._seen.setdefault(worker.address, Seen(row))
                seen.row, seen.gone_at = row, 0.0
                if worker.role == Role.ENCODER and reply is not None:
                    sent = json.loads(reply.sender_stats_json or "{}").get("bytes_sent", -1)
                    if seen.bytes_sent >= 0 and sent >= seen.bytes_sent:
                        num_bytes += sent - seen.bytes_sent
                    seen.bytes_sent = sent
            for address, seen in list(self._seen.items()):
                if address in present:
                    continue
                if not seen.gone_at:
                    seen.gone_at = wall
                    seen.row = {**seen.row, "state": "gone", "in_flight": 0,
                                "problem": "left the pool (silent or deregistered)"}  # fmt: skip
                seen.row["last_seen_s"] = round(wall - seen.gone_at, 1)
                if wall - seen.gone_at > self.history_s:
                    del self._seen[address]
            self._points.append(self._point(wall, dt, tally, num_bytes))

    def _point(self, wall: float, dt: float, tally, num_bytes: int) -> dict:
        by_api = {api: 0 for api in APIS}
        errors = 0
        for (api, outcome), n in tally.requests.items():
            by_api[api] = by_api.get(api, 0) + n
            errors += n if outcome != "OK" else 0
        p50, p99 = percentile(tally.ttfts_s, 0.5), percentile(tally.ttfts_s, 0.99)
        return {
            "t": round(wall, 3),
            "requests_per_s": {api: round(n / dt, 3) for api, n in by_api.items()},
            "errors_per_s": round(errors / dt, 3),
            "ttft_p50_ms": None if p50 is None else round(p50 * 1e3, 2),
            "ttft_p99_ms": None if p99 is None else round(p99 * 1e3, 2),
            "transfer_gb_s": round(num_bytes / dt / 1e9, 6),
            "in_flight": self._admission.num_in_flight,
        }

    def state(self, show_addresses: bool) -> dict:
        """The JSON of ``GET /dashboard/state``."""
        with self._lock:
            rows = [dict(s.row) for s in self._seen.values()]
            points = list(self._points)
        for row in rows:
            address = row.pop("address")
            row["id"] = address if show_addresses else worker_id(address, row["role"])
            if show_addresses:
                row["address"] = address
        rows.sort(key=lambda r: (r["role"], r["state"] == "gone", r["id"]))
        pools = {
            role: {
                "healthy": sum(r["state"] == "healthy" for r in rows if r["role"] == role),
                "total": sum(r["state"] != "gone" for r in rows if r["role"] == role),
            }
            for role in ROLES
        }
        return {
            "now": round(time.time(), 3),
            "sample_s": self.sample_s,
            "history_s": self.history_s,
            "uptime_s": round(time.time() - self._started, 1),
            "show_addresses": show_addresses,
            "in_flight": self._admission.num_in_flight,
            "pools": pools,
            "workers": rows,
            "series": points,
        }
