"""Same-host transport: the sender maps the receiver's /dev/shm region files and memcpy's.

The session string lists the receiver's regions as ``name@base+nbytes`` joined by ``;``; a
destination address is translated to the matching mapping in this process. Only files named like
receive regions, regular and of exactly the advertised size, are ever mapped
(``regions.map_peer_region``), a mapping is never used with another size, and every segment must
fall inside one region: anything else is a ``BadDestinationError`` with nothing written.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Sequence

from .regions import SHM_DIR, Region, map_peer_region
from .transport import BaseTransport
from .types import BadDestinationError, TransferWriteError


class ShmTransport(BaseTransport):
    name = "shm"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[str, tuple[mmap.mmap, int]] = {}  # name -> (mapping, local address)
        self._sessions: dict[str, list[tuple[int, int, int]]] = {}  # -> [(base, nbytes, local)]

    @staticmethod
    def session_for(regions: Sequence[tuple[str, int, int]]) -> str:
        """Session string for regions ``(shm_name, base, nbytes)``."""
        return ";".join(f"{name}@{base}+{nbytes}" for name, base, nbytes in regions)

    def register(self, regions: Sequence[Region]) -> None:
        return None  # local memory needs no registration for memcpy

    def _resolve(self, session: str) -> list[tuple[int, int, int]]:
        with self._lock:
            table = self._sessions.get(session)
            if table is not None:
                return table
            table = []
            for item in session.split(";"):
                name, _, rest = item.partition("@")
                base, _, nbytes = rest.partition("+")
                size = int(nbytes)
                if name not in self._maps:
                    self._maps[name] = map_peer_region(name, size)
                elif len(self._maps[name][0]) != size:  # never trust a size over the mapping
                    raise ValueError(f"shm region {name} is mapped with another size")
                table.append((int(base), size, self._maps[name][1]))
            self._sessions[session] = table
            return table

    def write(
        self, session: str, src_addrs: list[int], dst_addrs: list[int], lengths: list[int]
    ) -> None:
        try:
            table = self._resolve(session)
        except (OSError, ValueError) as exc:
            raise BadDestinationError(f"cannot map the receiver's shm regions: {exc}") from exc
        with self._lock:  # mappings are only released under the lock
            if self._sessions.get(session) is not table:
                raise TransferWriteError("shm session released during the write")
            for src, dst, length in zip(src_addrs, dst_addrs, lengths, strict=True):
                for base, nbytes, local in table:
                    if base <= dst and dst + length <= base + nbytes:
                        ctypes.memmove(local + (dst - base), src, length)
                        break
                else:
                    raise BadDestinationError(f"destination {dst:#x}+{length} outside regions")

    def release_missing(self) -> None:
        """Unmap regions whose files are gone (the receiver closed); their memory is freed."""
        with self._lock:
            gone = [n for n in self._maps if not os.path.exists(os.path.join(SHM_DIR, n))]
            if not gone:
                return
            self._sessions = {
                key: table for key, table in self._sessions.items() if not _names(key) & set(gone)
            }
            for name in gone:
                mapped, _ = self._maps.pop(name)
                _close(mapped)

    def close(self) -> None:
        with self._lock:
            self._sessions.clear()
            maps, self._maps = self._maps, {}
        for mapped, _ in maps.values():
            _close(mapped)


def _names(session: str) -> set[str]:
    return {item.partition("@")[0] for item in session.split(";")}


def _close(mapped: mmap.mmap) -> None:
    try:
        mapped.close()
    except BufferError:
        pass  # a view is still alive; the mapping goes with it
