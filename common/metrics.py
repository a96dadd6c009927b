"""Prometheus plumbing shared by the services.

Each service builds its metrics on its own ``CollectorRegistry`` (no process-global state) and
serves it on its metrics port. Gauges and counters that a component already keeps in its
``stats()``/load report are exported by a collector that reads them at scrape time, so the hot
paths carry no metrics code; event-time figures (latencies, batch sizes) are histograms the
service observes directly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler

NAMESPACE = "epd"
# Latency buckets from 1 ms to 2 min.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


class MetricsServer:
    def __init__(self, httpd: ThreadingHTTPServer) -> None:
        self._httpd = httpd
        self.port = httpd.server_address[1]
        self._thread = threading.Thread(target=httpd.serve_forever, daemon=True, name="metrics")
        self._thread.start()

    def shutdown(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def start_metrics_server(port: int, registry: CollectorRegistry, host: str = "0.0.0.0"):
    """Serve ``registry`` at ``http://host:port/metrics``."""
    handler = MetricsHandler.factory(registry)
    try:
        httpd = ThreadingHTTPServer((host, port), handler)
    except OSError as exc:
        raise OSError(f"cannot bind metrics port {host}:{port}: {exc.strerror}") from None
    return MetricsServer(httpd)


def histogram(
    registry: CollectorRegistry,
    name: str,
    doc: str,
    labels: Iterable[str] = (),
    buckets: tuple[float, ...] = LATENCY_BUCKETS,
) -> Histogram:
    return Histogram(
        name, doc, list(labels), namespace=NAMESPACE, buckets=buckets, registry=registry
    )


# (kind, metric name without namespace, help, key in the stats dict, labels)
StatSpec = tuple[str, str, str, str, dict[str, str]]


class StatsCollector:
    """Exports numbers from ``stats_fn()`` as gauges/counters at scrape time.

    ``specs`` rows: ``("gauge"|"counter", name, help, stats_key, const_labels)``; a key missing
    from the stats is skipped for that scrape. A ``stats_key`` whose value is a dict exports one
    series per entry, labelled by ``const_labels["_by"]``.
    """

    def __init__(self, stats_fn: Callable[[], dict], specs: list[StatSpec]) -> None:
        self._stats_fn = stats_fn
        self._specs = specs

    def describe(self) -> list[Metric]:
        return []  # unchecked: series appear with the stats

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self._stats_fn()
        except Exception:  # noqa: BLE001 - a failing stats call must not break the scrape
            return
        families: dict[str, Metric] = {}
        for kind, name, doc, key, labels in self._specs:
            value = stats.get(key)
            if value is None:
                continue
            full = f"{NAMESPACE}_{name}"
            by = labels.get("_by")
            const = {k: v for k, v in labels.items() if k != "_by"}
            names = sorted(const) + ([by] if by else [])
            fam = families.get(full)
            if fam is None:
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                fam = families[full] = cls(full, doc, labels=names)
            items = value.items() if isinstance(value, dict) and by else [(None, value)]
            for sub, v in items:
                values = [const[k] for k in sorted(const)] + ([str(sub)] if by else [])
                fam.add_metric(values, float(v))
        yield from families.values()
