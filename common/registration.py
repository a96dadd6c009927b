"""A worker's side of the gateway registry: heartbeat until stopped, deregister on the way out.

The gateway drops workers it has not heard from; the heartbeat carries the worker's load and
info (an encoder's transfer endpoint), so routing sees fresh figures without polling. A gateway
that is down or restarting is retried every interval; the worker keeps serving meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from protos.epd.v1 import registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)


class Registrar:
    def __init__(
        self,
        gateway: str,
        address: str,
        role: str,
        capacity: int,
        load_fn: Callable[[], dict[str, float]],
        info: dict[str, str] | None = None,
        interval_s: float = 1.0,
    ) -> None:
        self._address = address
        self._role = role
        self._capacity = capacity
        self._load_fn = load_fn
        self._info = dict(info or {})
        self._interval_s = interval_s
        self._channel = grpc.insecure_channel(gateway)
        self._stub = registry_pb2_grpc.WorkerRegistryStub(self._channel)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="registrar", daemon=True)
        self.num_heartbeats = 0

    def start(self) -> Registrar:
        self._thread.start()
        return self

    def beat(self) -> None:
        """One heartbeat now; raises grpc.RpcError when the gateway is unreachable."""
        reply = self._stub.Heartbeat(
            registry_pb2.HeartbeatRequest(
                address=self._address,
                role=self._role,
                capacity=self._capacity,
                load=self._load_fn(),
                info=self._info,
            ),
            timeout=max(self._interval_s, 1.0),
        )
        self.num_heartbeats += 1
        if reply.interval_s > 0:
            self._interval_s = reply.interval_s

    def _loop(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                self.beat()
                if failing:
                    log.info("registered with the gateway again")
                failing = False
            except grpc.RpcError as exc:
                if not failing:
                    log.warning("gateway heartbeat failed: %s", exc.code())
                failing = True
            self._stop.wait(self._interval_s)

    def stop(self) -> None:
        """Stop heartbeating and leave the registry (best effort)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self._stub.Deregister(
                registry_pb2.DeregisterRequest(address=self._address), timeout=1.0
            )
        except grpc.RpcError:
            pass
        self._channel.close()
