"""Prometheus series of one side of the transfer plane, read from its ``stats()``."""

from __future__ import annotations

from collections.abc import Callable

from common.metrics import StatsCollector


def transfer_collector(side: str, stats_fn: Callable[[], dict]) -> StatsCollector:
    """``side`` is "sender" (encoder) or "receiver" (language worker)."""
    byte_key = "bytes_sent" if side == "sender" else "bytes_received"
    labels = {"side": side}

    def stats() -> dict:
        s = dict(stats_fn())
        s["rooms_by_state"] = dict(s.get("rooms_active", {}))
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
            ("gauge", "transfer_blocks_free", "free 128-token blocks", "num_free_blocks", labels),
            ("gauge", "transfer_blocks_used", "used 128-token blocks", "num_used_blocks", labels),
        ],
    )
