"""Transports move bytes from local registered memory into a peer's registered regions.

All transports share one interface: ``write(session, src_addrs, dst_addrs, lengths)`` performs
one batched, synchronous write of all segments and raises ``TransferWriteError`` on failure.
``session`` names the destination: a Mooncake ``host:rpcport``, or for shm the receiver's
region list (see ``ShmTransport.session_for``). The sender picks shm only when the receiver
declares the same ``host_id`` and both configs allow it.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from collections.abc import Sequence

from .regions import Region


class BaseTransport(ABC):
    name: str
    # Each segment costs a round trip of its own (Mooncake tcp: a TCP connection, ~30 us),
    # so a chunk's small fields travel better inside its status (minor 6) than as segments.
    costly_segments: bool = False

    @abstractmethod
    def register(self, regions: Sequence[Region]) -> None:
        """Make local regions usable as write sources/destinations (each registered once)."""

    @abstractmethod
    def write(
        self, session: str, src_addrs: list[int], dst_addrs: list[int], lengths: list[int]
    ) -> None:
        """One batched synchronous write; raises TransferWriteError on failure."""

    @abstractmethod
    def close(self) -> None: ...


def host_id() -> str:
    """Identity of this machine's memory: hostname plus kernel boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "unknown-boot"
    return f"{socket.gethostname()}/{boot_id}"


def uses_mooncake(transport: str) -> bool:
    return transport in ("mooncake", "auto")


def uses_shm(transport: str) -> bool:
    return transport in ("shm", "auto")
