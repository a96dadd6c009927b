"""A whole stack on 127.0.0.1: G gateways, N encoders, M language workers, each a process.

Used by ``epd run``, the benchmarks and the end-to-end tests, so all of them start the services
the same way: ``epd serve ROLE`` children that register by heartbeat with the registry port of
*every* gateway (``--gateway`` lists them all). Each gateway gets two ports: the public API and
the worker registry (free ports unless given). ``start_worker`` adds a worker to a running stack
(the scale-up path); a worker stopped with SIGTERM drains and leaves every gateway;
``restart_gateway`` restarts a gateway in place (it drains first).

Memory: every language worker sizes its KV pool as a fraction of the host's free memory, and
here they share one host with the encoders. Unless the caller sizes the pool itself (flags or
environment), each of the M language workers gets ``LOCAL_KV_SHARE / M`` of the free memory, so
the stack cannot overcommit the host whatever M is. The CPU pool's pages are committed only as
they are used, so a share costs nothing until it is filled.

Security is off unless asked for: a caller that turns on TLS, API keys or the internal token
(by flags or ``env`` for the processes) passes ``public`` / ``internal`` — how the stack's own
helpers reach the gateways' public ports and the internal ports — so that health checks, the
registry listing and ``channel()`` present the same credentials.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc

from common.channels import ChannelSecurity, create_channel
from common.procs import ServiceProcess, free_port

LOCAL_KV_SHARE = 0.5  # of the host's free memory, for all the stack's language workers together
KV_SIZING = {  # flags of the language worker that size its KV pool, and their variables
    "--kv-cache-memory-fraction": "EPD_LANGUAGE_KV_CACHE_MEMORY_FRACTION",
    "--kv-cache-memory-mb": "EPD_LANGUAGE_KV_CACHE_MEMORY_MB",
    "--num-kv-slots": "EPD_LANGUAGE_NUM_KV_SLOTS",
}
STOP_TIMEOUT_S = 15.0


def kv_share_args(
    num_languages: int, worker_args: tuple[str, ...], env: dict[str, str] | None
) -> list[str]:
    """``--kv-cache-memory-fraction`` for one of ``num_languages`` workers on this host, or
    nothing when the caller sizes the KV pool already."""
    given = {a.split("=", 1)[0] for a in worker_args}
    environment = {**os.environ, **(env or {})}
    if any(flag in given or var in environment for flag, var in KV_SIZING.items()):
        return []
    return ["--kv-cache-memory-fraction", f"{LOCAL_KV_SHARE / max(num_languages, 1):.4f}"]


@dataclass(frozen=True)
class WorkerLaunch:
    """How the stack starts a worker, kept to start more later (``start_worker``)."""

    model_dir: Path
    log_dir: Path
    worker_args: tuple[str, ...] = ()
    language_args: tuple[str, ...] = ()  # the KV share
    env: dict[str, str] | None = None
    metrics: bool = False


@dataclass
class LocalStack:
    gateways: list[ServiceProcess] = field(default_factory=list)
    encoders: list[ServiceProcess] = field(default_factory=list)
    languages: list[ServiceProcess] = field(default_factory=list)
    metrics_ports: dict[str, int] = field(default_factory=dict)  # by process name
    registry_ports: list[int] = field(default_factory=list)  # one per gateway, in order
    public: ChannelSecurity | None = None  # what the gateways' public ports demand
    internal: ChannelSecurity | None = None  # what the registries and the workers demand
    http_port: int = 0  # the first gateway's HTTP API (OpenAI-compatible, /dashboard); 0: none
    launch: WorkerLaunch | None = None
    num_started: dict[str, int] = field(default_factory=dict)  # processes ever started, by role
    gateway_args: list[list[str]] = field(default_factory=list)  # each gateway's command line
    ports: set[int] = field(default_factory=set)  # every port handed to a process of the stack

    def new_port(self) -> int:
        """A free port no other process of the stack was given: bind-to-0 can return a port
        again before the process it went to has bound it (two servers on one port: one fails)."""
        port = free_port(avoid=self.ports)
        self.ports.add(port)
        return port

    @property
    def gateway(self) -> ServiceProcess:
        """The first gateway."""
        return self.gateways[0]

    @property
    def registry_port(self) -> int:
        return self.registry_ports[0]

    @property
    def registry_address(self) -> str:
        """Where workers register and operators list them (the first gateway's internal port)."""
        return self.registry_addresses[0]

    @property
    def http_url(self) -> str:
        """The first gateway's HTTP API (``http://127.0.0.1:PORT``); "" when it serves none."""
        if not self.http_port:
            return ""
        scheme = "https" if self.public is not None and self.public.tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self.http_port}"

    @property
    def registry_addresses(self) -> list[str]:
        """Every gateway's registry, in the gateways' order (workers' ``--gateway``)."""
        return [f"127.0.0.1:{port}" for port in self.registry_ports]

    @property
    def gateway_addresses(self) -> list[str]:
        """Every gateway's public address, in order."""
        return [g.address for g in self.gateways]

    def workers(self, registry_address: str | None = None) -> list:
        """A gateway's ``ListWorkers`` (``registry_pb2.WorkerInfo`` of every worker it knows);
        the first gateway's by default."""
        from common.registration import list_workers

        return list_workers(registry_address or self.registry_address, security=self.internal)

    def channel(self, address: str | None = None) -> grpc.Channel:
        """A channel to ``address`` with the credentials it demands: the public ones for a
        gateway's public port (the first gateway by default), the internal ones for any other."""
        address = address or self.gateway.address
        security = self.public if address in self.gateway_addresses else self.internal
        return create_channel(address, security)

    @property
    def procs(self) -> list[ServiceProcess]:
        return [*self.gateways, *self.encoders, *self.languages]

    def client(self, all_gateways: bool = False):
        """A ``GatewayClient`` of the first gateway, or of every gateway (it moves on from one
        that is unavailable)."""
        from services.gateway.client import GatewayClient

        return GatewayClient(self.gateway_addresses if all_gateways else self.gateway.address)

    def wait_registered(self, timeout_s: float) -> None:
        """Until every live worker is registered and healthy at every live gateway."""
        want = {p.address for p in self.encoders + self.languages if p.alive()}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pairs = zip(self.gateways, self.registry_addresses, strict=True)
            live = [registry for gateway, registry in pairs if gateway.alive()]
            try:
                if all(want <= {w.address for w in self.workers(r) if w.healthy} for r in live):
                    return
            except grpc.RpcError:
                pass  # a gateway still starting
            time.sleep(0.1)
        raise TimeoutError(f"workers not registered with every gateway: {sorted(want)}")

    def start_worker(
        self,
        role: str,
        extra_args: tuple[str, ...] = (),
        timeout_s: float = 180.0,
        wait: bool = True,
    ) -> ServiceProcess:
        """One more worker of ``role`` (``encoder`` | ``language``) that registers with every
        gateway; with ``wait``, returns once it is healthy (not waiting for the gateways to list
        it)."""
        assert self.launch is not None, "a stack made by start_local_stack"
        proc = _worker(self, role, extra_args)
        if wait:
            proc.wait_healthy(timeout_s)
        return proc

    def restart_gateway(self, index: int, timeout_s: float = 180.0) -> ServiceProcess:
        """Restart gateway ``index`` in place: SIGTERM (it drains its streams), wait until it
        exited, start it again on the same ports, and return once every live worker is
        registered with it again (they heartbeat the same address)."""
        assert self.launch is not None, "a stack made by start_local_stack"
        old = self.gateways[index]
        old.kill(signal.SIGTERM)
        old.proc.wait(timeout_s)
        old.stop()
        restarts = self.num_started.get("gateway-restart", 0) + 1
        self.num_started["gateway-restart"] = restarts
        name = f"{old.name}-r{restarts}"
        new = ServiceProcess(
            name,
            self.gateway_args[index],
            old.address,
            self.launch.log_dir,
            self.launch.env,
            self.public,
        )
        self.gateways[index] = new
        new.wait_healthy(timeout_s)
        self.wait_registered(timeout_s)
        return new

    @contextlib.contextmanager
    def serving(self) -> Iterator[LocalStack]:
        """The stack for the ``with`` block, stopped when it ends; when the block fails, each
        process's log tail goes to stderr first (what a failed benchmark leaves to read)."""
        try:
            yield self
        except BaseException:
            print(self.log_tails(), file=sys.stderr)
            raise
        finally:
            self.stop()

    def log_tails(self) -> str:
        """The last lines of each process's log, under its name."""
        return "\n".join(f"--- {proc.name} log ---\n{proc.tail()}" for proc in self.procs)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to every process at once (each drains: nothing is in flight at teardown, so
        that is quick), then SIGKILL to what did not exit within ``timeout_s``."""
        procs = list(reversed(self.procs))
        for proc in procs:
            proc.kill(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill(signal.SIGKILL)
        for proc in procs:
            proc.stop()  # reaps and closes the log


def _worker(stack: LocalStack, role: str, extra_args: tuple[str, ...] = ()) -> ServiceProcess:
    """Start (not wait for) a worker of ``role`` that registers with every gateway."""
    launch = stack.launch
    assert launch is not None
    index = stack.num_started.get(role, 0)
    stack.num_started[role] = index + 1
    name, port = f"{role}-{index}", stack.new_port()
    metrics: list[str] = []
    if launch.metrics:
        stack.metrics_ports[name] = stack.new_port()
        metrics = ["--metrics-port", str(stack.metrics_ports[name])]
    own = launch.language_args if role == "language" else ()
    cmd = ["serve", role, "--model-path", str(launch.model_dir), "--port", str(port),
           "--gateway", ",".join(stack.registry_addresses), *metrics, *own,
           *launch.worker_args, *extra_args]  # fmt: skip
    proc = ServiceProcess(
        name, cmd, f"127.0.0.1:{port}", launch.log_dir, launch.env, stack.internal
    )
    (stack.encoders if role == "encoder" else stack.languages).append(proc)
    return proc


S = TypeVar("S", bound=LocalStack)


def start_local_stack(
    model_dir: Path,
    log_dir: Path,
    num_encoders: int = 1,
    num_languages: int = 1,
    gateway_port: int = 0,
    gateway_args: tuple[str, ...] = (),
    worker_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    metrics: bool = False,
    startup_timeout_s: float = 180.0,
    on_progress: Callable[[str], None] | None = None,
    stack_cls: type[S] = LocalStack,
    registry_port: int = 0,
    public: ChannelSecurity | None = None,
    internal: ChannelSecurity | None = None,
    http_port: int | None = None,
    num_gateways: int = 1,
) -> S:
    """Start everything and return once all workers are healthy and registered with every
    gateway.

    ``gateway_port`` / ``registry_port`` are the first gateway's (0 picks free ports; the other
    gateways always get free ones). ``http_port``: the first gateway's HTTP API on that port (0:
    a free one; None: no HTTP API). With ``metrics`` each process serves Prometheus metrics on a
    free port. On any failure the processes already started are stopped before the error
    propagates.
    """
    if num_gateways < 1:
        raise ValueError(f"a stack needs at least one gateway, got {num_gateways}")
    say = on_progress or (lambda _msg: None)
    if http_port is not None:
        http_port = http_port or free_port()
    stack = stack_cls(
        public=public,
        internal=internal,
        http_port=http_port or 0,
        launch=WorkerLaunch(
            Path(model_dir),
            Path(log_dir),
            tuple(worker_args),
            tuple(kv_share_args(num_languages, worker_args, env)),
            env,
            metrics,
        ),
    )
    stack.ports.add(stack.http_port)  # 0 when it has none: never handed out
    try:
        for i in range(num_gateways):
            name = "gateway" if i == 0 else f"gateway-{i}"
            port = (gateway_port if i == 0 else 0) or stack.new_port()
            registry = (registry_port if i == 0 else 0) or stack.new_port()
            stack.ports.update((port, registry))
            stack.registry_ports.append(registry)
            metrics_args: list[str] = []
            if metrics:
                stack.metrics_ports[name] = stack.new_port()
                metrics_args = ["--metrics-port", str(stack.metrics_ports[name])]
            http_args = ["--http-port", str(http_port)] if i == 0 and http_port else []
            cmd = ["serve", "gateway", "--port", str(port), "--registry-port", str(registry),
                   *http_args, *metrics_args, *gateway_args]  # fmt: skip
            stack.gateway_args.append(cmd)
            address = f"127.0.0.1:{port}"
            stack.gateways.append(ServiceProcess(name, cmd, address, log_dir, env, public))
        for role, count in (("encoder", num_encoders), ("language", num_languages)):
            for _ in range(count):
                _worker(stack, role)

        def where(proc: ServiceProcess) -> str:
            if proc in stack.gateways:
                registry = stack.registry_addresses[stack.gateways.index(proc)]
                http = (
                    f", HTTP API {stack.http_url}"
                    if proc is stack.gateway and stack.http_url
                    else ""
                )
                return f"{proc.address} (worker registry {registry}{http})"
            return proc.address

        for proc in stack.procs:
            say(f"  starting {proc.name:<12} {where(proc)}")
        for proc in stack.procs:
            proc.wait_healthy(startup_timeout_s)
            say(f"  healthy   {proc.name:<12} {where(proc)}")
        stack.wait_registered(startup_timeout_s)
    except BaseException:
        stack.stop()
        raise
    return stack
