"""Prometheus series of one side of the transfer plane, read from its ``stats()``."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry

from common.metrics import StatsCollector, histogram

CONTINUATION_BUCKETS = (0, 1, 2, 3, 4, 8, 16, 32)


def register_transfer_metrics(registry: CollectorRegistry, side: str, endpoint) -> None:
    """Series of a sender or receiver ``endpoint``: scrape-time stats, plus the event-time
    histograms (chunk write seconds on the sender, continuations per room on the receiver)."""
    registry.register(transfer_collector(side, endpoint.stats))
    labels = {"side": side}
    if side == "sender":
        seconds = histogram(registry, "transfer_seconds", "seconds per chunk write", ["side"])
        endpoint.on_write = lambda nbytes, s: seconds.labels(**labels).observe(s)
    else:
        continuations = histogram(
            registry,
            "transfer_continuations_per_room",
            "continuations a room needed",
            ["side"],
            buckets=CONTINUATION_BUCKETS,
        )
        endpoint.on_room_done = lambda n: continuations.labels(**labels).observe(n - 1)


def transfer_collector(side: str, stats_fn: Callable[[], dict]) -> StatsCollector:
    """``side`` is "sender" (encoder) or "receiver" (language worker)."""
    byte_key = "bytes_sent" if side == "sender" else "bytes_received"
    labels = {"side": side}

    def stats() -> dict:
        s = dict(stats_fn())
        s["rooms_by_state"] = dict(s.get("rooms_active", {}))
        s["frames_by_outcome"] = {
            k: v
            for k, v in s.get("messages", {}).items()
            if k == "handled" or k.startswith("dropped")
        }
        return s

    return StatsCollector(
        stats,
        [
            ("counter", "transfer_bytes", "embedding bytes moved", byte_key, labels),
            (
                "counter",
                "transfer_chunks",
                "chunk transfers (first + continuations)",
                "num_transfers",
                labels,
            ),
            (
                "counter",
                "transfer_failed_rooms",
                "rooms failed, by reason",
                "failed_by_reason",
                {**labels, "_by": "reason"},
            ),
            (
                "gauge",
                "transfer_rooms",
                "live rooms by state",
                "rooms_by_state",
                {**labels, "_by": "state"},
            ),
            (
                "counter",
                "transfer_control_frames",
                "control frames by outcome (handled, or dropped_* when refused: unauthenticated, "
                "replayed, oversized, foreign version, ...)",
                "frames_by_outcome",
                {**labels, "_by": "outcome"},
            ),
            ("gauge", "transfer_blocks_free", "free 128-token blocks", "num_free_blocks", labels),
            ("gauge", "transfer_blocks_used", "used 128-token blocks", "num_used_blocks", labels),
            (
                "gauge",
                "transfer_blocks_lent",
                "used blocks lent to delivered rooms (zero-copy, until the engine releases them)",
                "num_lent_blocks",
                labels,
            ),
        ],
    )
