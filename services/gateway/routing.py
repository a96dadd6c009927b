"""Routing policies: which worker of a pool gets a request.

Every policy returns the healthy workers in order of preference; the gateway takes the first and
falls back to the next on a failure before any work started. Policies are pluggable per pool:

* ``round_robin`` — rotate.
* ``least_load`` — fewest in-flight requests relative to capacity.
* ``affinity`` — for encoders, rendezvous hashing on the images' content hashes (the embedding
  cache lives on the encoder that saw the image); for language workers, cache-aware: the worker
  that most recently served the longest prefix of this prompt (text parts and image hashes), as
  its radix cache probably still holds it. Both give way to load: an affine worker busier than the
  least loaded one by more than ``slack`` in-flight requests loses its preference.
"""

from __future__ import annotations

import itertools
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from services.gateway.registry import Role, Worker


@dataclass(frozen=True)
class RoutingKey:
    """What the gateway knows of a request before any worker saw it."""

    image_hashes: tuple[bytes, ...] = ()
    # Cumulative hashes of the prompt's parts in order: prefix_hashes[i] identifies parts[:i+1].
    prefix_hashes: tuple[int, ...] = ()


def _load(worker: Worker) -> tuple[float, int, str]:
    return (worker.in_flight / max(worker.capacity, 1), worker.in_flight, worker.address)


class BasePolicy(ABC):
    @abstractmethod
    def choose(self, workers: list[Worker], key: RoutingKey) -> tuple[list[Worker], str]:
        """``workers`` in order of preference for ``key``, and why the first was chosen
        ("affinity", "load" or "round_robin")."""

    def order(self, workers: list[Worker], key: RoutingKey) -> list[Worker]:
        return self.choose(workers, key)[0]

    def on_routed(self, worker: Worker, key: RoutingKey) -> None:  # noqa: B027 - optional hook
        """Called once the request went to ``worker``."""


class RoundRobinPolicy(BasePolicy):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, workers: list[Worker], key: RoutingKey) -> tuple[list[Worker], str]:
        if not workers:
            return [], "round_robin"
        ordered = sorted(workers, key=lambda w: w.address)
        start = next(self._counter) % len(ordered)
        return ordered[start:] + ordered[:start], "round_robin"


class LeastLoadPolicy(BasePolicy):
    def choose(self, workers: list[Worker], key: RoutingKey) -> tuple[list[Worker], str]:
        return sorted(workers, key=_load), "load"


def _prefer_within_slack(
    preferred: Worker | None, workers: list[Worker], slack: int
) -> tuple[list[Worker], str]:
    by_load = sorted(workers, key=_load)
    if preferred is None or not by_load:
        return by_load, "load"
    if preferred.in_flight > by_load[0].in_flight + slack:
        return by_load, "load"
    return [preferred] + [w for w in by_load if w is not preferred], "affinity"


class EncoderAffinityPolicy(BasePolicy):
    """Rendezvous hashing on the images' content: same images, same encoder."""

    def __init__(self, slack: int) -> None:
        self._slack = slack

    def choose(self, workers: list[Worker], key: RoutingKey) -> tuple[list[Worker], str]:
        if not key.image_hashes:
            return sorted(workers, key=_load), "load"
        digest = b"".join(key.image_hashes)
        preferred = max(
            workers,
            key=lambda w: xxhash.xxh3_64_intdigest(digest + w.address.encode()),
            default=None,
        )
        return _prefer_within_slack(preferred, workers, self._slack)


class CacheAwarePolicy(BasePolicy):
    """Longest remembered prompt prefix per worker, bounded per worker (LRU)."""

    def __init__(self, slack: int, max_prefixes_per_worker: int = 65536) -> None:
        self._slack = slack
        self._max = max_prefixes_per_worker
        self._lock = threading.Lock()
        self._seen: dict[str, OrderedDict[int, None]] = {}

    def match_len(self, worker: Worker, key: RoutingKey) -> int:
        with self._lock:
            seen = self._seen.get(worker.address)
            if not seen:
                return 0
            for i in range(len(key.prefix_hashes), 0, -1):
                if key.prefix_hashes[i - 1] in seen:
                    return i
        return 0

    def choose(self, workers: list[Worker], key: RoutingKey) -> tuple[list[Worker], str]:
        best, best_len = None, 0
        for worker in sorted(workers, key=_load):
            n = self.match_len(worker, key)
            if n > best_len:
                best, best_len = worker, n
        return _prefer_within_slack(best, workers, self._slack)

    def on_routed(self, worker: Worker, key: RoutingKey) -> None:
        with self._lock:
            seen = self._seen.setdefault(worker.address, OrderedDict())
            for h in key.prefix_hashes:
                seen[h] = None
                seen.move_to_end(h)
            while len(seen) > self._max:
                seen.popitem(last=False)

    def forget(self, address: str) -> None:
        with self._lock:
            self._seen.pop(address, None)


def create_policy(name: str, role: Role, slack: int) -> BasePolicy:
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_load":
        return LeastLoadPolicy()
    if name == "affinity":
        return EncoderAffinityPolicy(slack) if role == Role.ENCODER else CacheAwarePolicy(slack)
    raise ValueError(f"unknown routing policy {name!r}")
