"""Clients of the gateway's registry (its internal port).

A worker's side: ``Registrar`` heartbeats until stopped and deregisters on the way out. The
gateway drops workers it has not heard from; the heartbeat carries the worker's load and info
(an encoder's transfer endpoint), so routing sees fresh figures without polling. A gateway that
is down or restarting is retried every interval; the worker keeps serving meanwhile.

An operator's side: ``list_workers`` and ``wait_for_workers`` read the pools.

Both present the internal credentials (``common.channels.ChannelSecurity``) when the registry
demands them; a refused heartbeat is logged with the registry's reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from common.channels import ChannelSecurity, create_channel
from common.load_figures import LoadReply, descriptor, load_figures
from protos.epd.v1 import registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)


class Registrar:
    def __init__(
        self,
        gateway: str,
        address: str,
        role: str,
        capacity: int,
        report_fn: Callable[[], LoadReply],
        info: dict[str, str] | None = None,
        interval_s: float = 1.0,
        security: ChannelSecurity | None = None,
    ) -> None:
        """``report_fn`` returns the worker's own ``GetLoad`` reply: each heartbeat carries its
        load figures and descriptor (``common.load_figures``). ``gateway`` is the registry
        address; ``security`` what the registrar presents there."""
        self._address = address
        self._role = role
        self._capacity = capacity
        self._report_fn = report_fn
        self._info = dict(info or {})
        self._interval_s = interval_s
        self._channel = create_channel(gateway, security, max_message_mb=4)
        self._stub = registry_pb2_grpc.WorkerRegistryStub(self._channel)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="registrar", daemon=True)
        self.num_heartbeats = 0

    def start(self) -> Registrar:
        self._thread.start()
        return self

    def beat(self) -> None:
        """One heartbeat now; raises grpc.RpcError when the gateway is unreachable."""
        report = self._report_fn()
        reply = self._stub.Heartbeat(
            registry_pb2.HeartbeatRequest(
                address=self._address,
                role=self._role,
                capacity=self._capacity,
                load=load_figures(report),
                info=self._info,
                **descriptor(report),
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
                    log.warning("gateway heartbeat failed: %s: %s", exc.code().name, exc.details())
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


def list_workers(
    registry_address: str, timeout_s: float = 5.0, security: ChannelSecurity | None = None
) -> list[registry_pb2.WorkerInfo]:
    """Every worker the gateway at ``registry_address`` (its registry port) knows."""
    with create_channel(registry_address, security, keepalive=False) as channel:
        stub = registry_pb2_grpc.WorkerRegistryStub(channel)
        return list(stub.ListWorkers(registry_pb2.ListWorkersRequest(), timeout=timeout_s).workers)


def wait_for_workers(
    registry_address: str,
    num_encoders: int,
    num_languages: int,
    timeout_s: float,
    security: ChannelSecurity | None = None,
) -> None:
    """Until at least this many healthy workers of each role are registered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            roles = [w.role for w in list_workers(registry_address, security=security) if w.healthy]
        except grpc.RpcError:
            roles = []
        if roles.count("encoder") >= num_encoders and roles.count("language") >= num_languages:
            return
        time.sleep(0.2)
    raise TimeoutError("workers did not register with the gateway in time")
