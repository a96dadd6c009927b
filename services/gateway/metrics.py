"""The gateway's Prometheus series (namespace ``epd``) and its recent-activity tally.

Every finished request counts once in ``epd_gateway_requests_total{outcome, api}``: ``outcome``
is its terminal gRPC status name (``OK``, ``INVALID_ARGUMENT``, ...), ``api`` the front door it
came through (``grpc`` | ``http``, ``frontdoor.Api``). ``GatewayMetrics.finished`` is the one
place that counts; it also feeds ``RecentRequests``, which the status page's sampler drains
every few seconds (requests per API and time-to-first-token samples of that interval).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from common.metrics import NAMESPACE, histogram
from services.gateway.registry import ROLES, WorkerRegistry

MAX_RECENT_TTFTS = 4096  # per sampling interval; more are subsampled away


class _WorkerCollector:
    """Pool health and per-worker in-flight, read from the registry at scrape time."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self._registry = registry

    def describe(self):
        return []

    def collect(self):
        workers = self._registry.all()
        pools = GaugeMetricFamily(
            f"{NAMESPACE}_gateway_workers", "workers by role and state", labels=["role", "state"]
        )
        for role in ROLES:
            members = [w for w in workers if w.role.value == role]
            healthy = sum(w.healthy for w in members)
            pools.add_metric([role, "healthy"], healthy)
            pools.add_metric([role, "unhealthy"], len(members) - healthy)
        in_flight = GaugeMetricFamily(
            f"{NAMESPACE}_gateway_worker_in_flight",
            "requests the gateway has on each worker",
            labels=["worker", "role"],
        )
        for w in workers:
            in_flight.add_metric([w.address, w.role.value], w.in_flight)
        yield pools
        yield in_flight


@dataclass
class Tally:
    """What finished in one interval: requests by API and outcome, TTFTs of the OK ones."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)  # (api, outcome) -> n
    ttfts_s: list[float] = field(default_factory=list)


class RecentRequests:
    """A thread-safe tally of finished requests, taken (and reset) by the status page."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tally = Tally()

    def add(self, api: str, outcome: str, ttft_s: float | None) -> None:
        with self._lock:
            key = (api, outcome)
            self._tally.requests[key] = self._tally.requests.get(key, 0) + 1
            if ttft_s is not None and len(self._tally.ttfts_s) < MAX_RECENT_TTFTS:
                self._tally.ttfts_s.append(ttft_s)

    def take(self) -> Tally:
        with self._lock:
            tally, self._tally = self._tally, Tally()
        return tally


class GatewayMetrics:
    def __init__(self, workers: WorkerRegistry) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "gateway_requests",
            "finished requests by outcome (gRPC status) and front door (grpc|http)",
            ["outcome", "api"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.routing = Counter(
            "gateway_routing_decisions",
            "routing decisions by role and reason",
            ["role", "reason"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.ttft = histogram(r, "gateway_time_to_first_token_seconds", "admission to first token")
        self.itl = histogram(r, "gateway_inter_token_latency_seconds", "time between tokens")
        self.e2e = histogram(r, "gateway_e2e_request_latency_seconds", "admission to the end")
        self.queue = histogram(r, "gateway_queue_time_seconds", "admission to dispatch")
        self.recent = RecentRequests()
        r.register(_WorkerCollector(workers))
        # NOTE: the labelled children, looked up once per label pair (``labels`` takes a lock and
        # builds the key on every call, a few microseconds per request on a small machine)
        self._requests: dict[tuple[str, str], Counter] = {}
        self._routed: dict[tuple[str, str], Counter] = {}

    def finished(self, outcome: str, api: str, ttft_s: float | None = None) -> None:
        """Count one finished request (every outcome, refusals included)."""
        child = self._requests.get((outcome, api))
        if child is None:
            child = self._requests.setdefault((outcome, api), self.requests.labels(outcome, api))
        child.inc()
        self.recent.add(api, outcome, ttft_s)

    def routed(self, role: str, reason: str) -> None:
        """Count one routing decision of ``role``'s pool (``epd_gateway_routing_decisions``)."""
        child = self._routed.get((role, reason))
        if child is None:
            child = self._routed.setdefault((role, reason), self.routing.labels(role, reason))
        child.inc()
