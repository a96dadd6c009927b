"""The encoder's side of the transfer plane: encoded prompts -> ``EmbeddingSender``.

The ViT loop only enqueues (``Shipper.ship``). A shipper thread calls ``sender.submit``; when the
sender is short of blocks (``False``) the room is retried every ``retry_s`` until ``timeout_s``,
then failed. Submitted rooms are polled until the sender reports SUCCESS or FAILED (the sender
owns the receiver-side timeouts). Nothing here waits on a receiver.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import Protocol

from common.transfer.types import MAX_EXTRA_BYTES, AuxInfo, RoomState

from .rooms import RoomTable
from .types import EncodedPrompt, RoomStatus

logger = logging.getLogger(__name__)


class Sender(Protocol):
    """What the shipper needs of ``common.transfer.EmbeddingSender``."""

    endpoint: str

    def submit(self, room, fill_ids, positions, image_rows, aux, image_mask=None) -> bool: ...
    def fail(self, room: int, reason: str) -> None: ...
    def poll(self, room: int) -> RoomState: ...
    def stats(self) -> dict: ...
    def close(self) -> None: ...


class DiscardingSender:
    """``--sender none``: accepts every room and drops it (encoder-only benchmarks, probes)."""

    endpoint = ""

    def submit(self, room, fill_ids, positions, image_rows, aux, image_mask=None) -> bool:
        return True

    def fail(self, room: int, reason: str) -> None:
        pass

    def poll(self, room: int) -> RoomState:
        return RoomState.SUCCESS

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def aux_extra(encoded: EncodedPrompt) -> bytes:
    """Small JSON for the language side: image hashes, tokens per image, cache hits, timing.

    Hashes are shortened, then dropped, when the record would exceed ``MAX_EXTRA_BYTES``.
    """
    info = {
        "hashes": encoded.image_hashes,
        "tokens": encoded.image_token_counts,
        "hits": encoded.num_cache_hits,
        "encode_s": round(encoded.encode_s, 6),
    }
    for hash_len in (32, 16, 0):
        info["hashes"] = [h[:hash_len] for h in encoded.image_hashes] if hash_len else []
        data = json.dumps(info, separators=(",", ":")).encode()
        if len(data) <= MAX_EXTRA_BYTES:
            return data
    return b"{}"


def aux_info(encoded: EncodedPrompt) -> AuxInfo:
    return AuxInfo(
        total_tokens=encoded.num_tokens,
        num_image_rows=int(encoded.image_rows.shape[0]),
        mrope_delta=encoded.mrope_delta,
        num_items=encoded.num_items,
        extra=aux_extra(encoded),
    )


class Shipper:
    def __init__(self, sender: Sender, rooms: RoomTable, retry_s: float, timeout_s: float) -> None:
        self.sender = sender
        self._rooms = rooms
        self._retry_s = retry_s
        self._timeout_s = timeout_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: dict[int, tuple[EncodedPrompt, float]] = {}  # room -> (data, deadline)
        self._submitted: set[int] = set()
        self._stop = threading.Event()
        self.num_submit_retries = 0
        self._thread = threading.Thread(target=self._run, name="epd-shipper", daemon=True)
        self._thread.start()

    def ship(self, room: int, encoded: EncodedPrompt) -> None:
        """Hand ``encoded`` over; never blocks."""
        self._inbox.put((room, encoded))

    @property
    def num_waiting_for_blocks(self) -> int:
        return len(self._waiting)

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = bool(self._waiting or self._submitted)
            try:
                item = self._inbox.get(timeout=self._retry_s if busy else 0.1)
            except queue.Empty:
                item = None
            while item is not None:
                room, encoded = item
                self._waiting[room] = (encoded, time.monotonic() + self._timeout_s)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            self._try_submit()
            self._poll_submitted()

    def _try_submit(self) -> None:
        now = time.monotonic()
        for room, (encoded, deadline) in list(self._waiting.items()):
            try:
                ok = self.sender.submit(
                    room,
                    encoded.fill_ids,
                    encoded.positions,
                    encoded.image_rows,
                    aux_info(encoded),
                    image_mask=encoded.image_mask,
                )
            except Exception as exc:  # a bad room must not stop the others
                logger.exception("submit of room %d failed", room)
                del self._waiting[room]
                self._rooms.update(room, RoomStatus.FAILED, f"submit failed: {exc}")
                continue
            if ok:
                del self._waiting[room]
                self._submitted.add(room)
                self._rooms.update(room, RoomStatus.SUBMITTED)
            elif now > deadline:
                del self._waiting[room]
                reason = f"no transfer blocks free for {self._timeout_s:g}s"
                self.sender.fail(room, reason)
                self._rooms.update(room, RoomStatus.FAILED, reason)
            else:
                self.num_submit_retries += 1

    def _poll_submitted(self) -> None:
        for room in list(self._submitted):
            try:
                state = self.sender.poll(room)
            except KeyError:  # forgotten by the sender: it cannot be delivered any more
                state = RoomState.FAILED
            if state == RoomState.SUCCESS:
                self._rooms.update(room, RoomStatus.SHIPPED)
            elif state == RoomState.FAILED:
                self._rooms.update(room, RoomStatus.FAILED, "transfer failed")
            else:
                continue
            self._submitted.discard(room)
