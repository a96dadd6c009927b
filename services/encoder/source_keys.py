"""Encoded bytes -> the key their decoding gives, so a repeated image or video skips decoding.

An item's identity (pad ids, radix keys, cache entries, affinity) hashes what decoding gives:
an image's RGB pixels, a video's sampled frames with how they were sampled. Decoding is
deterministic, so the same bytes (and, for a video, the same sampling plan) always give the same
key; this table remembers it. When the embedding cache still holds that key's rows, the item is
served without decoding a pixel (a 60 s clip: its 120 frames' decoding and RGB conversion).

An entry is found by BLAKE2b-128 of the bytes (and the plan), a cryptographic digest: a crafted
file cannot take another file's entry. Entries are a few dozen bytes; least recently used ones
go first past ``capacity``.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Decoded:
    """What decoding some bytes gave: the item's key and, for an image, its decoded size
    (EXIF orientation applied), which sets its grid."""

    key: bytes
    width: int = 0
    height: int = 0


def source_digest(kind: bytes, data: bytes, context: bytes = b"") -> bytes:
    """BLAKE2b-128 of an item's encoded bytes, what kind of item it is and ``context`` (a
    video's sampling plan)."""
    h = hashlib.blake2b(digest_size=16, person=kind[:16])
    h.update(len(context).to_bytes(8, "little"))
    h.update(context)
    h.update(data)
    return h.digest()


class SourceKeys:
    """Bounded LRU ``digest -> Decoded``; thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[bytes, Decoded] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, digest: bytes) -> Decoded | None:
        with self._lock:
            decoded = self._entries.get(digest)
            if decoded is not None:
                self._entries.move_to_end(digest)
            return decoded

    def put(self, digest: bytes, decoded: Decoded) -> None:
        with self._lock:
            self._entries[digest] = decoded
            self._entries.move_to_end(digest)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
