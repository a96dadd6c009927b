"""The gateway's Prometheus series (namespace ``epd``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from common.metrics import NAMESPACE, histogram
from services.gateway.registry import ROLES, WorkerRegistry


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


class GatewayMetrics:
    def __init__(self, workers: WorkerRegistry) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "gateway_requests",
            "finished requests by outcome (gRPC status)",
            ["outcome"],
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
        r.register(_WorkerCollector(workers))
