"""Liveness of control-plane peers: heartbeat schedule and silence detection.

Not thread-safe on its own; the owning side calls it under its lock. Any message from a peer
counts as a sign of life, and any message to a peer as a heartbeat: one is due only after
``interval_s`` without sending it anything (so none interrupts a room whose messages flow). A
peer becomes relevant again (fresh grace period) when a room is associated with it after it had
none.
"""

from __future__ import annotations

from collections.abc import Iterable


class PeerTracker:
    def __init__(self, interval_s: float, timeout_s: float) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._last_seen: dict[str, float] = {}
        self._last_sent: dict[str, float] = {}

    def touch(self, endpoint: str, now: float) -> None:
        if endpoint:
            self._last_seen[endpoint] = now

    def watch(self, endpoint: str, now: float) -> None:
        """Start tracking ``endpoint`` unless it is already tracked (it just spoke to us, or we
        are about to speak to it: its first heartbeat is due ``interval_s`` from now)."""
        self._last_seen.setdefault(endpoint, now)
        self._last_sent.setdefault(endpoint, now)

    def sent(self, endpoint: str, now: float) -> None:
        """A message went to ``endpoint``: no heartbeat is due for ``interval_s``."""
        self._last_sent[endpoint] = now

    def due_heartbeats(self, endpoints: Iterable[str], now: float) -> list[str]:
        due = [ep for ep in endpoints if now - self._last_sent.get(ep, 0.0) >= self.interval_s]
        for ep in due:
            self._last_sent[ep] = now
        return due

    def silent(self, endpoints: Iterable[str], now: float) -> list[str]:
        return [ep for ep in endpoints if now - self._last_seen.get(ep, now) > self.timeout_s]

    def forget_idle(self, active: set[str]) -> None:
        """Drop peers without rooms so a later room starts with a fresh grace period."""
        for table in (self._last_seen, self._last_sent):
            for ep in [ep for ep in table if ep not in active]:
                del table[ep]
