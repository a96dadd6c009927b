"""A whole stack on 127.0.0.1: a gateway, N encoders, M language workers, each a process.

Used by ``epd run``, the end-to-end benchmark and the end-to-end tests, so all three start the
services the same way: ``epd serve ROLE`` children that register with the gateway's registry
port by heartbeat. The gateway gets two ports: the public API and the worker registry (a free
port unless one is given).

Security is off unless asked for: a caller that turns on TLS, API keys or the internal token
(by flags or ``env`` for the processes) passes ``public`` / ``internal`` — how the stack's own
helpers reach the gateway's public port and the internal ports — so that health checks, the
registry listing and ``channel()`` present the same credentials.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc

from common.channels import ChannelSecurity, create_channel
from common.procs import ServiceProcess, free_port


@dataclass
class LocalStack:
    gateway: ServiceProcess
    encoders: list[ServiceProcess] = field(default_factory=list)
    languages: list[ServiceProcess] = field(default_factory=list)
    metrics_ports: dict[str, int] = field(default_factory=dict)  # by process name
    registry_port: int = 0
    public: ChannelSecurity | None = None  # what the gateway's public port demands
    internal: ChannelSecurity | None = None  # what the registry and the workers demand
    http_port: int = 0  # the gateway's HTTP API (OpenAI-compatible, /dashboard); 0: none

    @property
    def registry_address(self) -> str:
        """Where workers register and operators list them (the gateway's internal port)."""
        return f"127.0.0.1:{self.registry_port}"

    @property
    def http_url(self) -> str:
        """The gateway's HTTP API (``http://127.0.0.1:PORT``); "" when it serves none."""
        if not self.http_port:
            return ""
        scheme = "https" if self.public is not None and self.public.tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self.http_port}"

    def workers(self) -> list:
        """The gateway's ``ListWorkers`` (``registry_pb2.WorkerInfo`` of every known worker)."""
        from common.registration import list_workers

        return list_workers(self.registry_address, security=self.internal)

    def channel(self, address: str | None = None) -> grpc.Channel:
        """A channel to ``address`` with the credentials it demands: the public ones for the
        gateway's public port (the default), the internal ones for any other process."""
        address = address or self.gateway.address
        security = self.public if address == self.gateway.address else self.internal
        return create_channel(address, security)

    @property
    def procs(self) -> list[ServiceProcess]:
        return [self.gateway, *self.encoders, *self.languages]

    def client(self):
        from services.gateway.client import GatewayClient

        return GatewayClient(self.gateway.address)

    def wait_registered(self, timeout_s: float) -> None:
        """Until every live worker is registered and healthy at the gateway."""
        want = {p.address for p in self.encoders + self.languages if p.alive()}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if want <= {w.address for w in self.workers() if w.healthy}:
                return
            time.sleep(0.1)
        raise TimeoutError(f"workers not registered with the gateway: {sorted(want)}")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


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
) -> S:
    """Start everything and return once all workers are healthy and registered.

    ``gateway_port`` / ``registry_port`` 0 pick free ports. ``http_port``: the gateway's HTTP
    API on that port (0: a free one; None: no HTTP API). With ``metrics`` each process serves
    Prometheus metrics on a free port. On any failure the processes already started are
    stopped before the error propagates.
    """
    say = on_progress or (lambda _msg: None)
    metrics_ports: dict[str, int] = {}

    def metrics_args(name: str) -> list[str]:
        if not metrics:
            return []
        metrics_ports[name] = free_port()
        return ["--metrics-port", str(metrics_ports[name])]

    port = gateway_port or free_port()
    registry_port = registry_port or free_port()
    http_args = []
    if http_port is not None:
        http_port = http_port or free_port()
        http_args = ["--http-port", str(http_port)]
    gateway_cmd = ["serve", "gateway", "--port", str(port), "--registry-port",
                   str(registry_port), *http_args, *metrics_args("gateway"),
                   *gateway_args]  # fmt: skip
    stack = stack_cls(
        ServiceProcess("gateway", gateway_cmd, f"127.0.0.1:{port}", log_dir, env, public),
        metrics_ports=metrics_ports,
        registry_port=registry_port,
        public=public,
        internal=internal,
        http_port=http_port or 0,
    )
    try:
        for role, count, group in (
            ("encoder", num_encoders, stack.encoders),
            ("language", num_languages, stack.languages),
        ):
            for i in range(count):
                name, wport = f"{role}-{i}", free_port()
                cmd = ["serve", role, "--model-path", str(model_dir), "--port", str(wport),
                       "--gateway", stack.registry_address, *metrics_args(name),
                       *worker_args]  # fmt: skip
                address = f"127.0.0.1:{wport}"
                group.append(ServiceProcess(name, cmd, address, log_dir, env, internal))

        def where(proc: ServiceProcess) -> str:
            if proc is stack.gateway:
                http = f", HTTP API {stack.http_url}" if stack.http_url else ""
                return f"{proc.address} (worker registry {stack.registry_address}{http})"
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
