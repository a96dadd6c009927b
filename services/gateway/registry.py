"""The gateway's view of the pools: who is there, healthy, and how loaded.

Workers either register themselves (``WorkerRegistry.Heartbeat``) and are dropped when silent
for ``worker_expiry_s`` (their calls in flight end then: see ``_end_calls``), or come from the
static list and are kept, marked unhealthy while their health check fails. The gateway holds
one long-lived channel per worker, made on first sight and closed when the worker is dropped,
and the stubs on it, made with the channel.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from grpc_health.v1 import health_pb2_grpc

from protos.epd.v1 import encoder_pb2_grpc, language_pb2_grpc
from services.gateway.sessions import SessionSlot


class Role(str, Enum):
    ENCODER = "encoder"
    LANGUAGE = "language"


logger = logging.getLogger(__name__)
MAX_UNANSWERED_POLLS = 3  # a static worker that answers none of these is unhealthy
ROLES = tuple(role.value for role in Role)


@dataclass(frozen=True)
class WorkerStubs:
    """The stubs the gateway calls a worker through (``services/gateway/workers.py``)."""

    health: Any  # health_pb2_grpc.HealthStub
    service: Any  # encoder_pb2_grpc.EncoderStub | language_pb2_grpc.LanguageServiceStub
    sessions: SessionSlot | None = None  # a language worker's (``sessions.py``)


def create_stubs(channel: Any, role: Role) -> WorkerStubs:
    """The stubs of a worker, made on its fresh channel.

    NOTE: grpcio 1.85 crashes the process (SIGSEGV) when a stub is made on a channel that was
    closed before any stub was made on it. A worker's channel is closed by whichever thread drops
    the worker, possibly while a request still holds it, so the stubs are made once, with the
    channel, before any other thread can see it; a call through them on a closed channel raises
    ``ValueError`` instead.
    """
    health = health_pb2_grpc.HealthStub(channel)
    if role == Role.ENCODER:
        return WorkerStubs(health, encoder_pb2_grpc.EncoderStub(channel))
    service = language_pb2_grpc.LanguageServiceStub(channel)
    return WorkerStubs(health, service, SessionSlot(channel))


@dataclass
class Worker:
    """One worker as the gateway sees it. Mutated only under the registry's lock."""

    address: str
    role: Role
    capacity: int
    static: bool
    channel: Any  # grpc.Channel (or a test double); one per worker, long-lived
    stubs: WorkerStubs | None = None  # made with the channel (``create_stubs``)
    last_seen: float = field(default_factory=time.monotonic)
    healthy: bool = True
    # The last poll (or call) found it unreachable at its address or not ready: a heartbeat
    # says it is alive, not that the gateway reaches it, so only a poll that passes clears it.
    failed_check: bool = False
    num_unanswered_polls: int = 0  # polls in a row it did not answer in time
    in_flight: int = 0
    load: dict[str, float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)  # e.g. an encoder's transfer endpoint
    # What it says of its shape (``common.load_figures.descriptor``): transfer_layout (a
    # common_pb2.TransferLayout), max_prompt_tokens (encoder), max_seq_len (language).
    descriptor: dict[str, Any] = field(default_factory=dict)


def _end_calls(channel: Any) -> None:
    """Close a silent worker's channel now, ending its calls in flight: a worker that answers
    nothing for ``worker_expiry_s`` (dead, hung, or its host cut off) would otherwise hold its
    streams until the transport gives up. A channel without ``abort`` (a plain one, a test
    double) is closed, which ends them too."""
    abort = getattr(channel, "abort", None)
    (abort or channel.close)()


class WorkerRegistry:
    """Thread-safe set of workers by role."""

    def __init__(
        self,
        expiry_s: float,
        channel_factory: Callable[[str], Any],
        clock: Callable[[], float] = time.monotonic,
        stub_factory: Callable[[Any, Role], WorkerStubs | None] = create_stubs,
    ) -> None:
        """``stub_factory(channel, role)`` makes a new worker's stubs (None: no stubs, for
        test doubles of channels)."""
        self._expiry_s = expiry_s
        self._channel_factory = channel_factory
        self._stub_factory = stub_factory
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[str, Worker] = {}

    def add_static(self, address: str, role: Role, capacity: int = 64) -> None:
        with self._lock:
            if address not in self._workers:
                self._workers[address] = self._new_worker(address, role, capacity, static=True)

    def heartbeat(
        self,
        address: str,
        role: Role,
        capacity: int,
        load: dict[str, float],
        info: dict[str, str] | None = None,
        descriptor: dict[str, Any] | None = None,
        still_wanted: Callable[[], bool] | None = None,
    ) -> bool:
        """Register or refresh a worker; a dropped worker comes back here. Before registering
        one, ``still_wanted()`` is asked under the lock: False (the worker gave up on this
        heartbeat, and may have deregistered since) leaves the registry as it is and returns
        False. A late heartbeat of a worker still registered refreshes it as any other."""
        with self._lock:
            worker = self._workers.get(address)
            if worker is None and still_wanted is not None and not still_wanted():
                return False
            if worker is None or worker.role != role:
                if worker is not None:
                    worker.channel.close()
                worker = self._new_worker(address, role, capacity, static=False)
                self._workers[address] = worker
                logger.info("%s worker %s registered", role.value, address)
            worker.capacity = capacity
            worker.load = dict(load)
            if info is not None:
                worker.info = dict(info)
            if descriptor is not None:
                worker.descriptor = dict(descriptor)
            worker.healthy = not worker.failed_check
            worker.last_seen = self._clock()
        return True

    def _new_worker(self, address: str, role: Role, capacity: int, static: bool) -> Worker:
        channel = self._channel_factory(address)
        stubs = self._stub_factory(channel, role)
        return Worker(address, role, capacity, static, channel, stubs, last_seen=self._clock())

    def deregister(self, address: str) -> bool:
        with self._lock:
            worker = self._workers.pop(address, None)
        if worker is not None:
            worker.channel.close()
            logger.info("%s worker %s deregistered", worker.role.value, address)
        return worker is not None

    def mark(
        self,
        address: str,
        healthy: bool | None,
        load: dict[str, float] | None = None,
        info: dict[str, str] | None = None,
        descriptor: dict[str, Any] | None = None,
    ) -> None:
        """Record a readiness/load poll of a worker. ``healthy`` None: no answer in time, which
        a busy worker may also give. A self-registered worker then turns unhealthy only when
        its heartbeats stopped too (none for half its expiry: hung, not busy); a static one
        after ``MAX_UNANSWERED_POLLS`` such polls in a row. ``healthy`` False (unreachable at
        its advertised address, or not ready) holds until a poll passes: its heartbeats, which
        reach the gateway from the worker's side, do not bring it back."""
        with self._lock:
            worker = self._workers.get(address)
            if worker is None:
                return
            if healthy is None:
                worker.num_unanswered_polls += 1
                if worker.static:
                    gone = worker.num_unanswered_polls >= MAX_UNANSWERED_POLLS
                else:
                    gone = self._clock() - worker.last_seen > self._expiry_s / 2
                if gone:
                    worker.healthy = False
                return
            worker.num_unanswered_polls = 0
            worker.healthy = healthy
            worker.failed_check = not healthy
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
            _end_calls(worker.channel)
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
