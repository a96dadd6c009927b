"""The language worker's Prometheus series (namespace ``epd``)."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry

from common.metrics import StatsCollector
from common.transfer_metrics import register_transfer_metrics


def create_registry(handle) -> CollectorRegistry:
    """Series for a running ``LanguageServer``."""
    registry = CollectorRegistry()
    engine_thread = handle.engine_thread
    registry.register(
        StatsCollector(
            lambda: dataclasses.asdict(engine_thread.load()),
            [
                (
                    "gauge",
                    "language_num_running_reqs",
                    "requests prefilling or decoding",
                    "num_running",
                    {},
                ),
                (
                    "gauge",
                    "language_num_waiting_reqs",
                    "requests waiting for admission",
                    "num_waiting",
                    {},
                ),
                (
                    "gauge",
                    "language_num_receiving_reqs",
                    "requests receiving embeddings",
                    "num_receiving",
                    {},
                ),
                (
                    "gauge",
                    "language_kv_slots_used",
                    "KV token slots in use",
                    "num_kv_slots_used",
                    {},
                ),
                (
                    "gauge",
                    "language_kv_slots_total",
                    "KV token slots in the pool",
                    "num_kv_slots_total",
                    {},
                ),
                (
                    "gauge",
                    "language_radix_tokens",
                    "tokens held by the radix cache",
                    "num_radix_tokens",
                    {},
                ),
                (
                    "counter",
                    "language_radix_hit_tokens",
                    "prompt tokens served from the radix cache",
                    "num_radix_hit_tokens",
                    {},
                ),
                (
                    "counter",
                    "language_evicted_tokens",
                    "tokens evicted from the radix cache",
                    "num_evicted_tokens",
                    {},
                ),
                (
                    "counter",
                    "language_prefill_tokens",
                    "prompt tokens computed",
                    "num_prefill_tokens",
                    {},
                ),
                ("counter", "language_decode_tokens", "tokens generated", "num_decode_tokens", {}),
            ],
        )
    )
    source = handle.embedding_source
    if source is not None and hasattr(source, "receiver"):
        register_transfer_metrics(registry, "receiver", source.receiver)
    return registry
