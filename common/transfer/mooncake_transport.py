"""Mooncake ``TransferEngine`` behind the transport interface (P2P handshake, no metadata server).

Its logging is quieted before the first import: ``GLOG_minloglevel=2`` (as FACTS.md says)
and ``MC_LOG_LEVEL=ERROR``, which is what this build (0.3.13.post1) actually honours.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .regions import Region
from .transport import BaseTransport
from .types import TransferWriteError


class MooncakeTransport(BaseTransport):
    name = "mooncake"

    def __init__(self, host: str, protocol: str = "tcp", device_names: str = "") -> None:
        os.environ.setdefault("GLOG_minloglevel", "2")
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        from mooncake.engine import TransferEngine  # heavy import, only when used

        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_names)
        if rc != 0:
            raise RuntimeError(f"Mooncake initialize({host}, {protocol}) failed: {rc}")
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: set[int] = set()

    def register(self, regions: Sequence[Region]) -> None:
        for region in regions:
            if region.base in self._registered:
                continue
            rc = self._engine.register_memory(region.base, region.nbytes)
            if rc != 0:
                raise RuntimeError(f"Mooncake register_memory failed: {rc}")
            self._registered.add(region.base)

    def write(
        self, session: str, src_addrs: list[int], dst_addrs: list[int], lengths: list[int]
    ) -> None:
        rc = self._engine.batch_transfer_sync_write(session, src_addrs, dst_addrs, lengths)
        if rc != 0:
            raise TransferWriteError(f"Mooncake batch write to {session} returned {rc}")

    def write_one(self, session: str, src_addr: int, dst_addr: int, nbytes: int) -> None:
        """A plain single-region write (the benchmark's raw baseline)."""
        rc = self._engine.transfer_sync_write(session, src_addr, dst_addr, nbytes)
        if rc != 0:
            raise TransferWriteError(f"Mooncake write to {session} returned {rc}")

    def close(self) -> None:
        for base in self._registered:
            self._engine.unregister_memory(base)
        self._registered.clear()
