"""The gateway's view of the pools: who is there, healthy, and how loaded.

Workers either register themselves (``WorkerRegistry.Heartbeat``) and are dropped when silent
for ``worker_expiry_s``, or come from the static list and are kept, marked unhealthy while
their health check fails. The gateway holds one long-lived channel per worker, made on first
sight and closed when the worker is dropped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Role(str, Enum):
    ENCODER = "encoder"
    LANGUAGE = "language"


ROLES = tuple(role.value for role in Role)


@dataclass
class Worker:
    """One worker as the gateway sees it. Mutated only under the registry's lock."""

    address: str
    role: Role
    capacity: int
    static: bool
    channel: Any  # grpc.Channel (or a test double); one per worker, long-lived
    last_seen: float = field(default_factory=time.monotonic)
    healthy: bool = True
    in_flight: int = 0
    load: dict[str, float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)  # e.g. an encoder's transfer endpoint
    # What it says of its shape (``common.load_figures.descriptor``): transfer_layout (a
    # common_pb2.TransferLayout), max_prompt_tokens (encoder), max_seq_len (language).
    descriptor: dict[str, Any] = field(default_factory=dict)


class WorkerRegistry:
    """Thread-safe set of workers by role."""

    def __init__(
        self,
        expiry_s: float,
        channel_factory: Callable[[str], Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._expiry_s = expiry_s
        self._channel_factory = channel_factory
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[str, Worker] = {}

    def add_static(self, address: str, role: Role, capacity: int = 64) -> None:
        with self._lock:
            if address not in self._workers:
                self._workers[address] = Worker(
                    address,
                    role,
                    capacity,
                    True,
                    self._channel_factory(address),
                    last_seen=self._clock(),
                )

    def heartbeat(
        self,
        address: str,
        role: Role,
        capacity: int,
        load: dict[str, float],
        info: dict[str, str] | None = None,
        descriptor: dict[str, Any] | None = None,
    ) -> None:
        """Register or refresh a worker; a dropped worker comes back here."""
        with self._lock:
            worker = self._workers.get(address)
            if worker is None or worker.role != role:
                if worker is not None:
                    worker.channel.close()
                worker = Worker(address, role, capacity, False, self._channel_factory(address))
                self._workers[address] = worker
            worker.capacity = capacity
            worker.load = dict(load)
            if info is not None:
                worker.info = dict(info)
            if descriptor is not None:
                worker.descriptor = dict(descriptor)
            worker.healthy = True
            worker.last_seen = self._clock()

    def deregister(self, address: str) -> bool:
        with self._lock:
            worker = self._workers.pop(address, None)
        if worker is not None:
            worker.channel.close()
        return worker is not None

    def mark(
        self,
        address: str,
        healthy: bool,
        load: dict[str, float] | None = None,
        info: dict[str, str] | None = None,
        descriptor: dict[str, Any] | None = None,
    ) -> None:
        """Record a health/load poll of a worker."""
        with self._lock:
            worker = self._workers.get(address)
            if worker is None:
                return
            worker.healthy = healthy
            if healthy:
                worker.last_seen = self._clock()
                if load is not None:
                    worker.load = dict(load)
                if info is not None:
                    worker.info = dict(info)
                if descriptor:
                    worker.descriptor = dict(descriptor)

    def expire(self) -> list[str]:
        """Drop self-registered workers silent for too long; static ones only turn unhealthy."""
        now = self._clock()
        dropped: list[Worker] = []
        with self._lock:
            for address, worker in list(self._workers.items()):
                if now - worker.last_seen <= self._expiry_s:
                    continue
                if worker.static:
                    worker.healthy = False
                else:
                    dropped.append(self._workers.pop(address))
        for worker in dropped:
            worker.channel.close()
        return [w.address for w in dropped]

    def healthy(self, role: Role) -> list[Worker]:
        with self._lock:
            return [w for w in self._workers.values() if w.role == role and w.healthy]

    def all(self) -> list[Worker]:
        with self._lock:
            return list(self._workers.values())

    def acquire(self, worker: Worker) -> None:
        with self._lock:
            worker.in_flight += 1

    def release(self, worker: Worker) -> None:
        with self._lock:
            worker.in_flight -= 1

    def age_s(self, worker: Worker) -> float:
        return self._clock() - worker.last_seen

    def close(self) -> None:
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        for worker in workers:
            worker.channel.close()
