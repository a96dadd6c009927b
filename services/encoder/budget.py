"""The byte budget of queued pixel tensors (``max_queued_pixel_mb``).

A request reserves the bytes of its images' patches (known from the headers) before any
pixel is decoded; the reservation is refused (``RESOURCE_EXHAUSTED``, the gateway tries another
encoder) when it would overflow the budget, except when nothing is held at all, so a single
request larger than the budget is still served, alone. Each image's share is given back the
moment its pixels are no longer needed: a cache hit at admission, a duplicate, the ViT having
consumed them, or the request being rejected, cancelled, expired or failed.

Invariants: ``used_bytes`` is the sum of ``held_bytes`` over live images (plus reservations of
requests still being admitted); an image gives its share back exactly once (``release_image``
zeroes it under the lock), so concurrent releases from the ViT thread and a cancel never
double-count.
"""

from __future__ import annotations

import threading

from .types import PreparedImage


class PixelBudget:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._used = 0
        self._peak = 0

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    @property
    def peak_bytes(self) -> int:
        with self._lock:
            return self._peak

    def try_reserve(self, nbytes: int) -> bool:
        """Take ``nbytes``; False (nothing taken) when they do not fit beside what is held."""
        with self._lock:
            if self._used and self._used + nbytes > self.capacity_bytes:
                return False
            self._used += nbytes
            self._peak = max(self._peak, self._used)
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            if nbytes < 0 or nbytes > self._used:
                raise ValueError(f"release of {nbytes} bytes with {self._used} held")
            self._used -= nbytes

    def release_image(self, image: PreparedImage) -> None:
        """Drop ``image``'s pixels and give its share back (once; later calls do nothing)."""
        with self._lock:
            nbytes, image.held_bytes = image.held_bytes, 0
            image.pixel_values = image.pending = None
            self._used -= nbytes
