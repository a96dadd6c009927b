"""Several "hosts" on one machine: network namespaces on a private bridge.

``Network`` makes, for one test session, a bridge inside a namespace of its own and, per host, a
namespace joined to that bridge by a veth pair, with its own address on a private /24. The test
process itself (the root namespace) gets one more veth pair into the bridge: it is the client
and the observer, and reaches every host's address; it sends traffic only to those. Names carry
a per-session id, so parallel runs do not collide:

    namespace   epdh-<sid>-br            the bridge ``ehb<sid>`` and the hosts' far ends
    namespace   epdh-<sid>-<host>        veth ``eh<sid>h<i>`` (address 10.X.Y.<10+i>)
    root        veth ``eh<sid>r``        address 10.X.Y.1

``cut(host)`` sets the host's veth down (its process keeps running: a partition, not a crash);
``restore(host)`` sets it up again. ``close()`` deletes every namespace and the root veth, which
removes the pairs with them; it runs also when a test fails (the fixture's teardown).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass

NAMESPACE_PREFIX = "epdh-"


def skip_reason() -> str:
    """Why namespaces cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (tests/hosts make one per role)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    return ""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@dataclass(frozen=True)
class Host:
    """One namespace with one address on the bridge."""

    name: str
    netns: str
    veth: str  # the host's end, inside ``netns``
    address: str

    @property
    def wrapper(self) -> list[str]:
        """The command prefix that runs a program on this host."""
        return ["ip", "netns", "exec", self.netns]


def _free_subnet() -> ipaddress.IPv4Network:
    """A random 10.x.y.0/24 that no route or address of this machine touches."""
    used = [
        ipaddress.ip_network(word, strict=False)
        for line in ip("-4", "route", "show", "table", "all").stdout.splitlines()
        for word in line.split()[:1]
        if "/" in word or word[:1].isdigit()
    ]
    for _ in range(100):
        net = ipaddress.ip_network(
            f"10.{secrets.randbelow(54) + 200}.{secrets.randbelow(256)}.0/24"
        )
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet for the test network")


class Network:
    """Namespaces on one bridge (see the module docstring)."""

    def __init__(self) -> None:
        self.sid = secrets.token_hex(2)
        while leftover_namespaces(self.sid):  # another run's (or a killed one's) id
            self.sid = secrets.token_hex(2)
        self.subnet = _free_subnet()
        self.bridge_ns = f"{NAMESPACE_PREFIX}{self.sid}-br"
        self.hosts: dict[str, Host] = {}
        self._root_veth = f"eh{self.sid}r"
        self._made: list[str] = []
        try:
            self._add_netns(self.bridge_ns)
            ip("-n", self.bridge_ns, "link", "add", f"ehb{self.sid}", "type", "bridge")
            ip("-n", self.bridge_ns, "link", "set", f"ehb{self.sid}", "up")
            self._plug(self._root_veth, f"eh{self.sid}rb", None)
            ip("addr", "add", f"{self.address(1)}/{self.subnet.prefixlen}", "dev", self._root_veth)
            ip("link", "set", self._root_veth, "up")
        except BaseException:
            self.close()
            raise

    def address(self, index: int) -> str:
        return str(self.subnet.network_address + index)

    @property
    def root_address(self) -> str:
        """The test process's own address on the network."""
        return self.address(1)

    def _add_netns(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def _plug(self, veth: str, far: str, netns: str | None) -> None:
        """A veth pair ``veth`` (moved into ``netns``; None: stays here) / ``far`` (on the
        bridge)."""
        ip("link", "add", veth, "type", "veth", "peer", "name", far)
        if netns is not None:
            ip("link", "set", veth, "netns", netns)
        ip("link", "set", far, "netns", self.bridge_ns)
        ip("-n", self.bridge_ns, "link", "set", far, "master", f"ehb{self.sid}")
        ip("-n", self.bridge_ns, "link", "set", far, "up")

    def add_host(self, name: str) -> Host:
        """A new namespace on the bridge, its veth up with the next address."""
        index = len(self.hosts)
        host = Host(
            name,
            f"{NAMESPACE_PREFIX}{self.sid}-{name}",
            f"eh{self.sid}h{index}",
            self.address(10 + index),
        )
        self._add_netns(host.netns)
        self._plug(host.veth, f"eh{self.sid}b{index}", host.netns)
        ip("-n", host.netns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev",
           host.veth)  # fmt: skip
        ip("-n", host.netns, "link", "set", host.veth, "up")
        self.hosts[name] = host
        return host

    def cut(self, host: Host) -> None:
        """Partition ``host``: its link goes down, its processes run on."""
        ip("-n", host.netns, "link", "set", host.veth, "down")

    def restore(self, host: Host) -> None:
        ip("-n", host.netns, "link", "set", host.veth, "up")

    def netem(self, host: Host, *spec: str) -> str:
        """Shape ``host``'s link with ``tc qdisc ... netem SPEC`` (``delay 20ms loss 2%``);
        returns why it cannot ("" when done): no ``tc``, or a kernel without netem."""
        if shutil.which("tc") is None:
            return "the `tc` command is missing"
        command = ["tc", "qdisc", "replace", "dev", host.veth, "root", "netem", *spec]
        done = subprocess.run(
            [*host.wrapper, *command], capture_output=True, text=True, timeout=30, check=False
        )
        if done.returncode:
            return f"tc netem: {done.stderr.strip() or done.returncode}"
        return ""

    def close(self) -> None:
        """Remove everything this network made (idempotent; errors are ignored: a namespace
        that is already gone is fine)."""
        ip("link", "del", self._root_veth, check=False)
        for name in reversed(self._made):
            ip("netns", "del", name, check=False)
        self._made.clear()


def leftover_namespaces(sid: str) -> list[str]:
    """Namespaces of session ``sid`` that still exist (for the teardown's own check)."""
    names = [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{NAMESPACE_PREFIX}{sid}-")]
