"""Clients of the gateways' registry (their internal port).

A worker's side: ``Registrar`` heartbeats to *every* gateway until stopped and deregisters from
each on the way out. ``--gateway`` is a comma-separated list of ``host:port``; a host that is a
name (a headless Service resolving to every gateway pod) stands for all its addresses and is
re-resolved every ``resolve_interval_s``: a gateway that appears gets heartbeats from then on, one
that disappears is forgotten. Each gateway is a ``_Target`` with its own channel and heartbeat
thread, so a gateway that is down delays no other. The gateway drops workers it has not heard
from; the heartbeat carries the worker's load and info (an encoder's transfer endpoint), so
routing sees fresh figures without polling, and since every gateway hears the same workers,
routing that must agree across gateways (encoder affinity by image hash) does. A gateway that
is down or restarting is retried every interval; the worker keeps serving meanwhile.

An operator's side: ``list_workers`` and ``wait_for_workers`` read the pools.

Both present the internal credentials (``common.channels.ChannelSecurity``) when the registry
demands them; a refused heartbeat is logged with the registry's reason.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.channels import ChannelSecurity, create_channel
from common.load_figures import LoadReply, descriptor, load_figures
from protos.epd.v1 import registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)

DEREGISTER_TIMEOUT_S = 3.0  # a loaded gateway may take a while; an unreachable one fails fast
# host, port -> the "address:port" targets it stands for (raises OSError when it cannot tell)
Resolver = Callable[[str, int], list[str]]


def parse_gateways(spec: str) -> list[tuple[str, int]]:
    """``"a:1,b:2"`` -> ``[("a", 1), ("b", 2)]``; ValueError naming an item that is not
    ``host:port`` (an IPv6 host in brackets: ``[::1]:50052``)."""
    out = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        host = host.strip("[]")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"gateway address {item!r} is not host:port")
        out.append((host, int(port)))
    return out


def is_address(host: str) -> bool:
    """Whether ``host`` is an IP address (as opposed to a name to resolve)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def resolve(host: str, port: int) -> list[str]:
    """Every address of ``host``: its IPv4 ones, else its IPv6 ones (a dual-stack name would
    otherwise stand for each gateway twice). Raises OSError when the name does not resolve."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    by_family: dict[int, set[str]] = {}
    for family, _type, _proto, _name, sockaddr in infos:
        by_family.setdefault(family, set()).add(str(sockaddr[0]))
    addresses = by_family.get(socket.AF_INET) or by_family.get(socket.AF_INET6) or set()
    return [join_host_port(a, port) for a in sorted(addresses)]


class _Target:
    """Heartbeats to one gateway's registry on a thread of its own."""

    def __init__(
        self, registrar: Registrar, address: str, name: str, security: ChannelSecurity | None
    ) -> None:
        self.address = address
        self.name = name  # the --gateway name it was resolved from ("" for an address)
        self._registrar = registrar
        self._interval_s = registrar.interval_s
        self._channel = create_channel(address, security, max_message_mb=4)
        self._stub = registry_pb2_grpc.WorkerRegistryStub(self._channel)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"registrar-{address}", daemon=True)
        self.num_heartbeats = 0

    def start(self) -> None:
        self._thread.start()

    def beat(self) -> None:
        """One heartbeat now; raises grpc.RpcError when the gateway is unreachable."""
        reply = self._stub.Heartbeat(
            self._registrar.heartbeat_request(), timeout=max(self._interval_s, 1.0)
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
                    log.info("registered with the gateway at %s again", self.address)
                failing = False
            except grpc.RpcError as exc:
                if not failing:
                    log.warning(
                        "heartbeat to the gateway at %s failed: %s: %s",
                        self.address,
                        exc.code().name,
                        exc.details(),
                    )
                failing = True
            self._stop.wait(self._interval_s)

    def stop(self, deregister: bool) -> None:
        """Stop heartbeating; with ``deregister``, leave the registry (best effort)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if deregister:
            request = registry_pb2.DeregisterRequest(address=self._registrar.address)
            try:
                self._stub.Deregister(request, timeout=DEREGISTER_TIMEOUT_S)
            except grpc.RpcError as exc:
                log.warning("could not deregister from %s: %s", self.address, exc.code().name)
        self._channel.close()


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
        resolve_interval_s: float = 2.0,
        resolver: Resolver = resolve,
    ) -> None:
        """``report_fn`` returns the worker's own ``GetLoad`` reply: each heartbeat carries its
        load figures and descriptor (``common.load_figures``). ``gateway`` is the registry
        addresses (``parse_gateways``); ``security`` what the registrar presents there."""
        self.address = address
        self.interval_s = interval_s
        self._gateways = parse_gateways(gateway)
        if not self._gateways:
            raise ValueError("no gateway registry address given (host:port)")
        self._role = role
        self._capacity = capacity
        self._report_fn = report_fn
        self._info = dict(info or {})
        self._security = security
        self._resolve_interval_s = resolve_interval_s
        self._resolver = resolver
        self._lock = threading.Lock()
        self._targets: dict[str, _Target] = {}
        self._unresolved: set[str] = set()  # names whose last resolution failed (logged once)
        self._stop = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        if any(not is_address(host) for host, _port in self._gateways):
            self._thread = threading.Thread(target=self._resolve_loop, name="registrar-dns")

    @property
    def targets(self) -> list[str]:
        """The gateway registry addresses heartbeated now."""
        with self._lock:
            return sorted(self._targets)

    @property
    def num_heartbeats(self) -> int:
        with self._lock:
            return sum(t.num_heartbeats for t in self._targets.values())

    def start(self) -> Registrar:
        self.refresh()
        if self._thread is not None:
            self._thread.daemon = True
            self._thread.start()
        return self

    def heartbeat_request(self) -> registry_pb2.HeartbeatRequest:
        report = self._report_fn()
        return registry_pb2.HeartbeatRequest(
            address=self.address,
            role=self._role,
            capacity=self._capacity,
            load=load_figures(report),
            info=self._info,
            **descriptor(report),
        )

    def beat(self) -> None:
        """One heartbeat to every gateway now; raises the first grpc.RpcError."""
        with self._lock:
            targets = list(self._targets.values())
        for target in targets:
            target.beat()

    def refresh(self) -> None:
        """Resolve ``--gateway`` again: start heartbeating new gateways, forget gone ones. A name
        that does not resolve keeps the gateways it stood for last time."""
        wanted: dict[str, str] = {}  # address -> the name it came from ("" for an address)
        with self._lock:
            previous = dict(self._targets)
        for host, port in self._gateways:
            if is_address(host):
                wanted[join_host_port(host, port)] = ""
                continue
            try:
                addresses = self._resolver(host, port)
                if not addresses:
                    raise OSError("no address")
            except OSError as exc:
                if host not in self._unresolved:
                    log.warning("cannot resolve gateway name %s: %s", host, exc)
                self._unresolved.add(host)
                addresses = [a for a, t in previous.items() if t.name == host]
            else:
                self._unresolved.discard(host)
            for address in addresses:
                wanted.setdefault(address, host)
        self._apply(wanted)

    def _apply(self, wanted: dict[str, str]) -> None:
        with self._lock:
            if self._stopped:
                return
            gone = [self._targets.pop(a) for a in list(self._targets) if a not in wanted]
            added = []
            for address, name in wanted.items():
                if address not in self._targets:
                    target = _Target(self, address, name, self._security_for(name))
                    self._targets[address] = target
                    added.append(target)
        for target in added:
            log.info("registering with the gateway at %s", target.address)
            target.start()
        for target in gone:
            log.info("the gateway at %s is gone from %s; forgotten", target.address, target.name)
            target.stop(deregister=False)

    def _security_for(self, name: str) -> ChannelSecurity | None:
        """The credentials for an address resolved from ``name``: TLS checks the certificate for
        that name unless a server name is configured (pods' certificates rarely list pod IPs)."""
        security = self._security
        if not name or security is None or security.tls is None or security.tls.server_name:
            return security
        tls = dataclasses.replace(security.tls, server_name=name)
        return dataclasses.replace(security, tls=tls)

    def _resolve_loop(self) -> None:
        while not self._stop.wait(self._resolve_interval_s):
            self.refresh()

    def stop(self) -> None:
        """Stop heartbeating and leave every gateway's registry (best effort, in parallel, at
        most ``DEREGISTER_TIMEOUT_S`` each). Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            targets, self._targets = list(self._targets.values()), {}
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=5)
        if not targets:
            return
        with ThreadPoolExecutor(len(targets), thread_name_prefix="deregister") as pool:
            list(pool.map(lambda t: t.stop(deregister=True), targets))


def list_workers(
    registry_address: str, timeout_s: float = 5.0, security: ChannelSecurity | None = None
) -> list[registry_pb2.WorkerInfo]:
    """Every worker the gateway at ``registry_address`` (its registry port) knows."""
    with create_channel(registry_address, security, keepalive=None) as channel:
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
