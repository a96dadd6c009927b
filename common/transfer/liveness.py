"""Liveness of control-plane peers: heartbeat schedule, silence and restart detection.

Not thread-safe on its own; the owning side calls it under its lock. A peer is tracked from the
moment a room is associated with it (``watch``) until it has no live room (``forget_idle``);
messages from untracked endpoints change nothing here, so a flood of strangers cannot grow the
table. Any message from a peer counts as a sign of life, and any message to a peer as a
heartbeat: one is due only after ``interval_s`` without sending it anything (so none interrupts
a room whose messages flow). A peer becomes relevant again (fresh grace period) when a room is
associated with it after it had none.

Each peer process stamps its messages with a random incarnation; a new one at a known endpoint
means the peer restarted and forgot every room it had (``touch`` returns the old one).
``next_due`` is the earliest time a heartbeat or a silence check needs the owner's attention.

Silence is what this side heard while it listened: when its own loop woke later than it planned
(its process starved of CPU, its thread of the interpreter), the lateness is ``overslept`` and
does not count against any peer, whose messages may be waiting unread.
"""

from __future__ import annotations

from collections.abc import Iterable


class PeerTracker:
    def __init__(self, interval_s: float, timeout_s: float) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._last_seen: dict[str, float] = {}
        self._last_sent: dict[str, float] = {}
        self._incarnation: dict[str, int] = {}

    def watch(self, endpoint: str, now: float, incarnation: int = 0) -> None:
        """Start tracking ``endpoint`` unless it is already tracked (it just spoke to us, or we
        are about to speak to it: its first heartbeat is due ``interval_s`` from now)."""
        self._last_seen.setdefault(endpoint, now)
        self._last_sent.setdefault(endpoint, now)
        if incarnation:
            self._incarnation.setdefault(endpoint, incarnation)

    def touch(self, endpoint: str, now: float, incarnation: int = 0) -> int:
        """A message from ``endpoint`` arrived; returns the peer's previous incarnation when
        this one differs (it restarted), else 0."""
        if endpoint not in self._last_seen:
            return 0
        self._last_seen[endpoint] = now
        if not incarnation:
            return 0  # a peer of an older minor version does not say
        previous = self._incarnation.get(endpoint, 0)
        self._incarnation[endpoint] = incarnation
        return previous if previous and previous != incarnation else 0

    def sent(self, endpoint: str, now: float) -> None:
        """A message went to ``endpoint``: no heartbeat is due for ``interval_s``."""
        if endpoint in self._last_sent:
            self._last_sent[endpoint] = now

    def due_heartbeats(self, endpoints: Iterable[str], now: float) -> list[str]:
        due = [ep for ep in endpoints if now - self._last_sent.get(ep, 0.0) >= self.interval_s]
        for ep in due:
            self._last_sent[ep] = now
        return due

    def overslept(self, seconds: float) -> None:
        """This side could not listen for ``seconds`` (it woke that late): no peer's silence
        grows by them."""
        for ep in self._last_seen:
            self._last_seen[ep] += seconds

    def silence(self, endpoint: str, now: float) -> float:
        """Seconds since ``endpoint`` was last heard (0 when it is not tracked)."""
        return now - self._last_seen.get(endpoint, now)

    def silent(self, endpoints: Iterable[str], now: float) -> list[str]:
        return [ep for ep in endpoints if self.silence(ep, now) >= self.timeout_s]

    def next_due(self, endpoints: Iterable[str]) -> float | None:
        """When the next heartbeat to, or silence check of, one of ``endpoints`` is due."""
        times = [
            min(self._last_sent.get(ep, 0.0) + self.interval_s, seen + self.timeout_s)
            for ep in endpoints
            if (seen := self._last_seen.get(ep)) is not None
        ]
        return min(times, default=None)

    def forget_idle(self, active: set[str]) -> None:
        """Drop peers without rooms so a later room starts with a fresh grace period."""
        for table in (self._last_seen, self._last_sent, self._incarnation):
            for ep in [ep for ep in table if ep not in active]:
                del table[ep]

    def __len__(self) -> int:
        return len(self._last_seen)
