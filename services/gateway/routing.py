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

from protos.epd.v1 import common_pb2
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


# ---- pairing by transfer layout ------------------------------------------------------------


def transfer_layout(worker: Worker) -> common_pb2.TransferLayout | None:
    """The layout ``worker`` advertises; None when it advertises none (an older worker)."""
    layout = worker.descriptor.get("transfer_layout")
    if layout is None or not (layout.hidden_size or layout.dtype):
        return None
    return layout


def _layout_key(layout: common_pb2.TransferLayout) -> tuple[int, int, str, int]:
    return (layout.hidden_size, layout.num_deepstack, layout.dtype, layout.block_size)


def describe_layout(layout: common_pb2.TransferLayout | None) -> str:
    if layout is None:
        return "no layout advertised"
    return (
        f"{layout.dtype or 'dtype unset'}, hidden {layout.hidden_size}, "
        f"deepstack {layout.num_deepstack}, block {layout.block_size}"
    )


def compatible(a: Worker, b: Worker) -> bool:
    """Whether ``a`` and ``b`` (an encoder and a language worker) can exchange image rows."""
    la, lb = transfer_layout(a), transfer_layout(b)
    return la is None or lb is None or _layout_key(la) == _layout_key(lb)


def pair(languages: list[Worker], encoders: list[Worker]) -> tuple[Worker, list[Worker]] | None:
    """The first of ``languages`` (in order of preference) with compatible ``encoders``, and
    those encoders (in the order given); None when no language worker has any."""
    for language in languages:
        fits = [e for e in encoders if compatible(language, e)]
        if fits:
            return language, fits
    return None


def no_pair_message(languages: list[Worker], encoders: list[Worker]) -> str:
    """Why ``pair`` found nothing: the preferred language worker's layout and the encoders'."""
    first = languages[0]
    others = len(languages) - 1
    nor = f" (nor that of the {others} other language workers)" if others else ""
    have = "; ".join(f"{describe_layout(transfer_layout(e))} ({e.address})" for e in encoders)
    return (
        f"no encoder shares language worker {first.address}'s transfer layout "
        f"({describe_layout(transfer_layout(first))}){nor}; encoders have: {have}"
    )


def worker_problems(workers: list[Worker]) -> dict[str, str]:
    """Why each worker gets no traffic, or only some: address -> note (routable ones absent)."""
    healthy = [w for w in workers if w.healthy]
    problems: dict[str, str] = {}
    for worker in workers:
        layout = transfer_layout(worker)
        partners = [w for w in healthy if w.role != worker.role]
        if not worker.healthy and worker.failed_check:
            problems[worker.address] = (
                "unhealthy: its last health check failed (the gateway cannot reach its "
                "advertised address, or it is not ready); its heartbeats alone do not bring it "
                "back"
            )
        elif not worker.healthy:
            problems[worker.address] = "unhealthy: silent (no heartbeat or poll answered)"
        elif layout is None:
            problems[worker.address] = (
                "advertises no transfer layout (an older worker): paired with any worker of the "
                "other pool, unchecked"
            )
        elif worker.role == Role.ENCODER and not partners:
            problems[worker.address] = "no healthy language worker to send image rows to"
        elif partners and not any(compatible(worker, p) for p in partners):
            other = "language worker" if worker.role == Role.ENCODER else "encoder"
            have = "; ".join(sorted({describe_layout(transfer_layout(p)) for p in partners}))
            note = f"no {other} shares this transfer layout ({describe_layout(layout)})"
            note += f"; {other}s have: {have}"
            if worker.role == Role.LANGUAGE:
                note += "; it serves text-only requests only"
            problems[worker.address] = note
    return problems
