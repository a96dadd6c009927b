"""What the sender and the receiver share: buffers, allocator, transports, control loop.

One background thread per side runs ``_loop``. It sleeps until the next real event: a control
frame, or the earliest time something is due (``_next_due``: a room's bound, a heartbeat, a
silence check, a quarantine expiry), which an API call that adds or moves a timer brings
forward with the channel's alarm (or, without one, a ``wake``). With no rooms nothing is due
and it sleeps until a frame comes.
After every wake-up it runs ``_on_tick``, which acts only on what is due.

Every frame that comes off the socket is counted once as ``received`` and then exactly once as
``handled`` (authenticated, decoded and given to ``_on_message``) or as ``dropped_<why>``:
``unauthenticated``, ``misdirected``, ``stale``, ``replayed`` (see ``auth.py``), ``garbage``,
``unknown_version``, ``empty``, ``bad_endpoint`` (not ``tcp://HOST:PORT``, or our own) or
``handler_error``. Other counters
(``unknown_room``, ``wrong_peer``...) say what a handled frame turned out to be. All room state
is guarded by ``self._lock``; callbacks run with it held.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable

from protos.epd.v1 import transfer_pb2

from . import messages
from .allocator import BlockAllocator
from .auth import FrameAuth, load_secret
from .buffers import DataBuffers
from .config import TransferConfig
from .control import ControlChannel
from .layout import BufferLayout
from .liveness import PeerTracker
from .shm_transport import ShmTransport
from .transport import host_id, uses_mooncake, uses_shm
from .types import RoomState

logger = logging.getLogger(__name__)

MAX_SLEEP_MS = 2**31 - 1  # zmq_poll takes a C long of milliseconds: ~24 days


WAKE_SLACK_S = 0.002  # a timer this much earlier than the loop's own wake-up does not wake it


class TransferEndpoint(ABC):
    def __init__(self, config: TransferConfig, layout: BufferLayout, shared: bool) -> None:
        if (layout.num_blocks, layout.block_size) != (config.num_blocks, config.block_size):
            raise ValueError(
                f"layout {layout.num_blocks}x{layout.block_size} blocks differs from config "
                f"{config.num_blocks}x{config.block_size} (build it with layout_for(config, ...))"
            )
        self.config = config
        self.layout = layout
        self.host_id = host_id()
        self.incarnation = int.from_bytes(os.urandom(8), "little") or 1
        self.counters: collections.Counter[str] = collections.Counter()
        self._lock = threading.RLock()
        self._closed = threading.Event()
        secret = load_secret(config.secret_file) if config.secret_file else None
        self.auth = FrameAuth(secret, config.auth_window_s)
        self.allocator = BlockAllocator(layout.num_blocks, layout.block_size)
        self.buffers = DataBuffers(layout, shared=shared)
        self.mooncake = None
        self.shm = ShmTransport() if uses_shm(config.transport) else None
        try:
            if uses_mooncake(config.transport):
                from .mooncake_transport import MooncakeTransport

                self.mooncake = MooncakeTransport(
                    config.bind_host,
                    config.protocol,
                    config.device_names,
                    config.transfer_timeout_s,
                )
                self.mooncake.register(list(self.buffers.regions.values()))
            self.channel = ControlChannel(
                config.bind_host,
                config.control_port,
                self.auth,
                config.max_peers,
                config.peer_idle_s,
            )
        except BaseException:
            self.buffers.close()
            raise
        self.endpoint = self.channel.endpoint
        self.peers = PeerTracker(config.heartbeat_interval_s, config.heartbeat_timeout_s)
        self.num_wakeups = 0  # loop iterations (frames, timers, wake calls): for idle checks
        self._sleep_until = math.inf  # when the loop wakes by itself next (set under the lock)
        self._thread = threading.Thread(
            target=self._loop, name=f"{type(self).__name__}-loop", daemon=True
        )
        self._thread.start()

    def _envelope(self) -> transfer_pb2.TransferEnvelope:
        return messages.envelope(self.endpoint, self.incarnation)

    def _wake(self) -> None:
        """Timers changed outside the loop thread: make it wake by the earliest of them. A
        wake-up now is a thread switch on the path of every small room, only to re-plan: with
        an alarm (``ControlChannel.set_alarm``) the loop's wake-up is moved earlier instead and
        it sleeps on; without one it is woken, and only when something is now due before it
        planned to wake by itself (else it finds the change when it wakes)."""
        with self._lock:
            due = self._next_due()
            if due is None or due >= self._sleep_until - WAKE_SLACK_S:
                return
            if self.channel.alarm:
                self.channel.set_alarm(due)
                self._sleep_until = due
                return
        self.channel.wake()

    def _loop(self) -> None:
        timeout_ms: int | None = None
        while not self._closed.is_set():
            try:
                frames = self.channel.recv(timeout_ms)
            except Exception:  # the context is being torn down
                if self._closed.is_set():
                    return
                raise
            # one hold of the lock for the frames and the timers: a consumer woken by a frame's
            # handler does not wake again to find the lock taken back for the tick
            with self._lock:
                late = time.monotonic() - self._sleep_until
                if late > 0:  # it could not listen meanwhile (see PeerTracker.overslept)
                    self.peers.overslept(late)
                for frame in frames:
                    self._dispatch(frame)
                self.num_wakeups += 1
                try:
                    self._on_tick(time.monotonic())
                    self.channel.close_idle()
                    due = self._next_due()
                except Exception:  # a bug: keep serving, and look again a little later
                    logger.exception("transfer tick failed")
                    due = time.monotonic() + self.config.heartbeat_interval_s
                if self.channel.alarm:  # sleep until a frame, a wake or the alarm
                    self.channel.set_alarm(due)
                    self._sleep_until = math.inf if due is None else due
                elif due is None:
                    timeout_ms, self._sleep_until = None, math.inf
                else:
                    now = time.monotonic()
                    timeout_ms = min(MAX_SLEEP_MS, max(0, math.ceil((due - now) * 1000)))
                    self._sleep_until = now + timeout_ms / 1000

    def _dispatch(self, frame: bytes) -> None:
        with self._lock:
            self.counters["received"] += 1
            try:
                self._dispatch_locked(frame)
            except Exception:  # a bug must cost one frame, never the loop
                self.counters["dropped_handler_error"] += 1
                logger.exception("failed to handle a control frame")

    def _dispatch_locked(self, frame: bytes) -> None:
        payload = self.auth.open(frame)
        if payload is None:
            self.counters["dropped_unauthenticated"] += 1
            return
        decoded = messages.decode(payload)
        env = decoded.envelope
        if env is None:
            self.counters[f"dropped_{decoded.error}"] += 1
            return
        problem = self.auth.check(env, self.endpoint)
        if problem:
            self.counters[f"dropped_{problem}"] += 1
            return
        if env.from_endpoint == self.endpoint or not messages.valid_endpoint(env.from_endpoint):
            self.counters["dropped_bad_endpoint"] += 1
            return
        previous = self.peers.touch(env.from_endpoint, time.monotonic(), env.incarnation)
        if previous:
            self._on_peer_restarted(env.from_endpoint, previous)
        self._on_message(env)
        self.counters["handled"] += 1

    def _send(self, endpoint: str, message: transfer_pb2.TransferEnvelope) -> None:
        """Send a control message (the caller holds the lock); it doubles as a heartbeat."""
        self.channel.send(endpoint, message)
        self.peers.sent(endpoint, time.monotonic())

    def _send_heartbeats(self, endpoints: set[str], now: float) -> None:
        self.peers.forget_idle(endpoints)
        for ep in self.peers.due_heartbeats(endpoints, now):
            msg = self._envelope()
            msg.heartbeat.sent_at = time.time()
            self._send(ep, msg)

    @abstractmethod
    def _on_message(self, env: transfer_pb2.TransferEnvelope) -> None: ...

    @abstractmethod
    def _on_peer_restarted(self, endpoint: str, old_incarnation: int) -> None:
        """``endpoint`` answers with a new incarnation: fail the rooms bound to the old one."""

    @abstractmethod
    def _on_tick(self, now: float) -> None:
        """Act on whatever is due at ``now`` (timeouts, heartbeats, silent peers)."""

    @abstractmethod
    def _next_due(self) -> float | None:
        """The earliest monotonic time ``_on_tick`` has something to do; None: nothing."""

    def _common_stats(self, finished: Iterable[RoomState]) -> dict:
        """Rooms by state and block counters; the caller holds the lock. Subclasses keep their
        live rooms in ``_rooms`` (room -> state holder) and pass the final states of ended
        ones."""
        by_state = collections.Counter(r.state.name for r in self._rooms.values())
        finished = collections.Counter(state.name for state in finished)
        return {
            "rooms_active": dict(by_state),
            "rooms_finished": dict(finished),
            "num_peers": len(self.peers),
            "num_control_sockets": self.channel.num_sockets,
            "num_dropped_sends": self.channel.num_dropped_sends,
            "num_wakeups": self.num_wakeups,
            **self._block_stats(),
        }

    def _block_stats(self) -> dict:
        return {
            "num_free_blocks": self.allocator.num_free_blocks,
            "num_used_blocks": self.allocator.num_used_blocks,
            "peak_used_blocks": self.allocator.peak_used_blocks,
        }

    def _close_endpoint(self) -> None:
        self._closed.set()
        self.channel.wake()
        self._thread.join(timeout=5)
        self.channel.close()
        if self.mooncake is not None:
            self.mooncake.close()
        if self.shm is not None:
            self.shm.close()
        self.buffers.close()
