"""A stack whose every process is a host of its own: gateways, encoders and language workers each
started the way a pod starts them (``epd serve ROLE``) inside a network namespace of its own,
all on one private bridge (``tests/hosts/netns.py``). Mooncake (tcp), the ZMQ control channel,
the registry and gRPC all cross real interfaces between distinct addresses; nothing relies on a
127.0.0.1 shortcut. Workers bind 0.0.0.0 and are given no address to advertise: they find the
one that routes to their gateways, as a pod does.

The tests here need root and iproute2 and skip with that reason otherwise. Every namespace is
removed after its test, also when it failed; the processes are stopped first and die with the
test process in any case (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from common.procs import ServiceProcess
from services.local_stack import WorkerLaunch, kv_share_args
from tests.e2e import conftest as e2e_conftest
from tests.e2e.conftest import FAST_TRANSFER_ENV, STACKS, STARTUP_S, Stack
from tests.hosts.netns import Host, Network, leftover_namespaces, skip_reason

# Each host has its own ports, so fixed ones never collide. Pings every 2 s, answered within 3 s:
# a peer cut off is found within ~3 s while its streams carry data, ~5 s when idle.
KEEPALIVE = ("--keepalive-s", "2", "--keepalive-timeout-s", "3")
GATEWAY_PORT, REGISTRY_PORT, WORKER_PORT = 7000, 7001, 7100
HOSTS_ENV = {**FAST_TRANSFER_ENV, "EPD_TRANSFER_TRANSPORT": "mooncake"}  # no shm across hosts
GATEWAY_ARGS = ("--host", "0.0.0.0", "--port", str(GATEWAY_PORT),
                "--registry-port", str(REGISTRY_PORT),
                "--worker-expiry-s", "3", "--health-poll-s", "0.5", *KEEPALIVE)  # fmt: skip
WORKER_ARGS = ("--host", "0.0.0.0", "--port", str(WORKER_PORT), "--heartbeat-interval-s", "0.5",
               *KEEPALIVE)  # fmt: skip


@dataclass
class HostStack(Stack):
    """A ``Stack`` whose processes run on the hosts of ``network``."""

    network: Network | None = None
    host_of: dict[str, Host] = field(default_factory=dict)  # by process name

    @property
    def registry_addresses(self) -> list[str]:
        return [f"{self.host_of[g.name].address}:{REGISTRY_PORT}" for g in self.gateways]

    def host(self, proc: ServiceProcess) -> Host:
        return self.host_of[proc.name]

    def cut(self, proc: ServiceProcess) -> None:
        """Partition ``proc``'s host (the process runs on)."""
        assert self.network is not None
        self.network.cut(self.host(proc))

    def restore(self, proc: ServiceProcess) -> None:
        assert self.network is not None
        self.network.restore(self.host(proc))

    def encoder_holds(self, index: int) -> str:
        """What encoder ``index`` still holds ("" when nothing: no rooms, blocks, patch
        bytes)."""
        load = self.encoder_load(index)
        blocks = json.loads(load.sender_stats_json or "{}").get("num_used_blocks", 0)
        if load.num_queued_requests or blocks or load.queued_pixel_bytes:
            return f"{load.num_queued_requests} rooms, {blocks} blocks, {load.queued_pixel_bytes} B"
        return ""

    def add_worker(self, role: str, extra_args: tuple[str, ...] = ()) -> ServiceProcess:
        """Start (not wait for) one more worker of ``role`` on a host of its own."""
        assert self.network is not None and self.launch is not None
        launch = self.launch
        index = self.num_started.get(role, 0)
        self.num_started[role] = index + 1
        name = f"{role}-{index}"
        host = self.network.add_host(f"{role[0]}{index}")
        own = launch.language_args if role == "language" else ()
        cmd = ["serve", role, "--model-path", str(launch.model_dir), *WORKER_ARGS,
               "--gateway", ",".join(self.registry_addresses), *own, *launch.worker_args,
               *extra_args]  # fmt: skip
        proc = ServiceProcess(
            name, cmd, f"{host.address}:{WORKER_PORT}", launch.log_dir, launch.env,
            wrapper=host.wrapper,
        )  # fmt: skip
        self.host_of[name] = host
        (self.encoders if role == "encoder" else self.languages).append(proc)
        return proc


def start_host_stack(
    network: Network,
    model_dir: Path,
    log_dir: Path,
    num_gateways: int = 1,
    num_encoders: int = 1,
    num_languages: int = 1,
    gateway_args: tuple[str, ...] = (),
    worker_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> HostStack:
    """Start every process on a host of its own; return once all workers are registered and
    healthy at every gateway."""
    env = {**HOSTS_ENV, **(env or {})}
    language_args = kv_share_args(num_languages, worker_args, env)
    launch = WorkerLaunch(model_dir, log_dir, worker_args, tuple(language_args), env)
    stack = HostStack(network=network, launch=launch)
    try:
        for i in range(num_gateways):
            name = "gateway" if i == 0 else f"gateway-{i}"
            host = network.add_host(f"g{i}")
            cmd = ["serve", "gateway", *GATEWAY_ARGS, *gateway_args]
            stack.gateway_args.append(cmd)
            stack.host_of[name] = host
            address = f"{host.address}:{GATEWAY_PORT}"
            stack.gateways.append(
                ServiceProcess(name, cmd, address, log_dir, env, wrapper=host.wrapper)
            )
        for role, count in (("encoder", num_encoders), ("language", num_languages)):
            for _ in range(count):
                stack.add_worker(role)
        for proc in stack.procs:
            proc.wait_healthy(STARTUP_S)
        stack.wait_registered(STARTUP_S)
    except BaseException:
        stack.stop()
        raise
    return stack


@pytest.fixture
def network() -> Iterator[Network]:
    """A private network for one test, removed afterwards (also when the test failed)."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    net = Network()
    yield net
    net.close()
    assert leftover_namespaces(net.sid) == []


@pytest.fixture
def host_stack_factory(network: Network, tmp_path: Path, request: pytest.FixtureRequest):
    """``host_stack_factory(model_dir, **kw)``: a ``HostStack`` stopped after the test, before
    its network is removed."""
    stacks = request.node.stash.setdefault(STACKS, [])

    def make(model_dir: Path, **kwargs) -> HostStack:
        stack = start_host_stack(network, model_dir, tmp_path, **kwargs)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        for proc in stack.procs:  # a host cut off by a failed test is let back to drain
            if stack.network is not None and proc.name in stack.host_of:
                stack.restore(proc)
        stack.stop()


def wait_until(condition, timeout_s: float, what: str):
    """The condition's first true value, polled every 0.1 s; AssertionError after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


pytest_runtest_makereport = e2e_conftest.pytest_runtest_makereport  # log tails of failed tests
