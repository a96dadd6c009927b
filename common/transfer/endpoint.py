"""What the sender and the receiver share: buffers, allocator, transports, control loop.

One background thread per side runs ``_loop``: it receives control frames (dropping and counting
garbage, truncated and foreign-version ones), dispatches them to ``_on_message`` and calls
``_on_tick`` at least every ``TICK_S`` for timeouts and heartbeats. All room state is guarded by
``self._lock``; callbacks run with it held.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from abc import ABC, abstractmethod

from protos.epd.v1 import transfer_pb2

from . import messages
from .allocator import BlockAllocator
from .buffers import DataBuffers
from .config import TransferConfig
from .control import ControlChannel
from .layout import BufferLayout
from .peers import PeerTracker
from .shm_transport import ShmTransport
from .transport import host_id, uses_mooncake, uses_shm

logger = logging.getLogger(__name__)

TICK_S = 0.02


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
        self.counters: collections.Counter[str] = collections.Counter()
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self.allocator = BlockAllocator(layout.num_blocks, layout.block_size)
        self.buffers = DataBuffers(layout, shared=shared)
        self.mooncake = None
        self.shm = ShmTransport() if uses_shm(config.transport) else None
        try:
            if uses_mooncake(config.transport):
                from .mooncake_transport import MooncakeTransport

                self.mooncake = MooncakeTransport(config.host, config.protocol, config.device_names)
                self.mooncake.register(list(self.buffers.regions.values()))
            self.channel = ControlChannel(config.host, config.control_port)
        except BaseException:
            self.buffers.close()
            raise
        self.endpoint = self.channel.endpoint
        self.peers = PeerTracker(config.heartbeat_interval_s, config.heartbeat_timeout_s)
        self._thread = threading.Thread(
            target=self._loop, name=f"{type(self).__name__}-loop", daemon=True
        )
        self._thread.start()

    def _envelope(self) -> transfer_pb2.TransferEnvelope:
        return messages.envelope(self.endpoint)

    def _loop(self) -> None:
        next_tick = time.monotonic()
        while not self._closed.is_set():
            timeout_ms = max(0, math.ceil((next_tick - time.monotonic()) * 1000))
            try:
                frames = self.channel.recv(timeout_ms)
            except Exception:  # the context is being torn down
                if self._closed.is_set():
                    return
                raise
            for frame in frames:
                self._dispatch(frame)
            now = time.monotonic()
            if now >= next_tick:
                with self._lock:
                    try:
                        self._on_tick(now)
                    except Exception:
                        logger.exception("transfer tick failed")
                next_tick = now + TICK_S

    def _dispatch(self, frame: bytes) -> None:
        decoded = messages.decode(frame)
        if decoded.envelope is None:
            self.counters[f"dropped_{decoded.error}"] += 1
            return
        env = decoded.envelope
        with self._lock:
            self.peers.touch(env.from_endpoint, time.monotonic())
            try:
                self._on_message(env)
            except Exception:
                self.counters["dropped_handler_error"] += 1
                logger.exception("failed to handle a %s message", env.WhichOneof("body"))

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
    def _on_tick(self, now: float) -> None: ...

    def _common_stats(self) -> dict:
        """Rooms by state and block counters; the caller holds the lock. Subclasses keep their
        live rooms in ``_rooms`` (room -> state holder) and ended ones in ``_finished``."""
        by_state = collections.Counter(r.state.name for r in self._rooms.values())
        finished = collections.Counter(s.name for s in self._finished.values())
        return {
            "rooms_active": dict(by_state),
            "rooms_finished": dict(finished),
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
        self._thread.join(timeout=5)
        self.channel.close()
        if self.mooncake is not None:
            self.mooncake.close()
        if self.shm is not None:
            self.shm.close()
        self.buffers.close()
