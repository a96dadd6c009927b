"""The encoder's side of the transfer plane: encoded rooms -> ``EmbeddingSender``.

The ViT loop only marks a room ENCODED and wakes the shipper. The shipper thread calls
``sender.submit``; when the sender is short of blocks (``False``) the room is retried every
``retry_s`` until the request's deadline, then failed. Submitted rooms are polled until the
sender reports SUCCESS or FAILED (the sender owns the receiver-side timeouts). Nothing here waits
on a receiver.

Image by image (``ship_per_image``): the ViT loop also wakes the shipper when a forward gave a
room some of its images; the shipper then begins the room at the sender with its tokens and the
rows of its first encoded images (``sender.begin``) and hands over each next image's rows as
they come (``sender.add_rows``), the last ones with the final metadata. The sender writes
what is ready, so the language worker prefills the first image while the ViT runs the next.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from common.transfer.types import AuxInfo, RoomState

from .aux_extra import encode_extra
from .rooms import RoomTable
from .types import EncodedPrompt, Prompt, RoomStatus

logger = logging.getLogger(__name__)

POLL_S = 0.02  # how often the rooms the sender holds are looked at (its own tick)


class Sender(Protocol):
    """What the encoder needs of ``common.transfer.EmbeddingSender``.

    Optionally also ``expect(room, deadline)`` ("the encoder accepted this room; its data comes,
    or the room fails, before ``deadline``"), called on accept when the sender has it.
    """

    endpoint: str

    def submit(self, room, fill_ids, positions, image_rows, aux, image_mask=None) -> bool: ...
    def begin(self, room, fill_ids, positions, aux, image_mask=None, image_rows=None) -> bool: ...
    def add_rows(self, room: int, image_rows, aux=None) -> None: ...
    def fail(self, room: int, reason: str) -> None: ...
    def poll(self, room: int) -> RoomState: ...
    def stats(self) -> dict: ...
    def close(self) -> None: ...


class DiscardingSender:
    """``--sender none``: accepts every room and drops it (encoder-only benchmarks, probes)."""

    endpoint = ""

    def submit(self, room, fill_ids, positions, image_rows, aux, image_mask=None) -> bool:
        return True

    def begin(self, room, fill_ids, positions, aux, image_mask=None, image_rows=None) -> bool:
        return True

    def add_rows(self, room: int, image_rows, aux=None) -> None:
        pass

    def expect(self, room: int, deadline: float) -> None:
        pass

    def fail(self, room: int, reason: str) -> None:
        pass

    def poll(self, room: int) -> RoomState:
        return RoomState.SUCCESS

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def early_aux_info(prompt: Prompt, num_cache_hits: int) -> AuxInfo:
    """The metadata of a room begun before its last image is encoded (no timings yet)."""
    return AuxInfo(
        total_tokens=prompt.num_tokens,
        num_image_rows=int(prompt.image_mask.sum()),
        mrope_delta=prompt.mrope_delta,
        num_items=len(prompt.items),
        extra=encode_extra(
            [item.key.hex() for item in prompt.items],
            [item.num_tokens for item in prompt.items],
            hits=num_cache_hits,
            encode_s=0.0,
        ),
    )


def aux_info(encoded: EncodedPrompt) -> AuxInfo:
    return AuxInfo(
        total_tokens=encoded.num_tokens,
        num_image_rows=int(encoded.image_rows.shape[0]),
        mrope_delta=encoded.mrope_delta,
        num_items=encoded.num_items,
        extra=encode_extra(
            encoded.image_hashes,
            encoded.image_token_counts,
            hits=encoded.num_cache_hits,
            encode_s=encoded.encode_s,
        ),
    )


class Shipper:
    """The thread between encoded rooms and the sender.

    It sleeps until woken (a room became ENCODED) or until its next retry: every ``retry_s``
    while a room waits for blocks, every ``poll_s`` while the sender holds rooms (the sender has
    no completion callback), and not at all when neither is the case. It keeps no state of its
    own: rooms are read from and moved in the ``RoomTable``. A room waits for blocks until its
    deadline; a submitted room past its deadline is failed at the sender too.
    """

    def __init__(
        self,
        sender: Sender,
        rooms: RoomTable,
        retry_s: float,
        poll_s: float = POLL_S,
        on_transfer_failed: Callable[[int, str], None] | None = None,
    ) -> None:
        self.sender = sender
        # a room begun image by image whose transfer failed while the ViT still works on it
        # (its receiver gave up): the encoder cancels it, freeing its ViT work and patches
        self._on_transfer_failed = on_transfer_failed
        self._rooms = rooms
        self._retry_s = retry_s
        self._poll_s = poll_s
        self._wake = threading.Event()
        self._stop = False
        self.num_submit_retries = 0
        self.num_passes = 0  # times the thread woke up and looked (it sleeps when idle)
        self._thread = threading.Thread(target=self._run, name="epd-shipper", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """A room became ENCODED (or something else changed): look now. Never blocks."""
        self._wake.set()

    @property
    def num_waiting_for_blocks(self) -> int:
        return self._rooms.num_in(RoomStatus.ENCODED)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        timeout: float | None = None
        while True:
            self._wake.wait(timeout)
            if self._stop:
                return
            self._wake.clear()
            self.num_passes += 1
            now = time.monotonic()
            blocked, begun = self._ship_early(now)
            blocked = self._submit(now) or blocked
            holding = self._poll(now) or begun
            timeout = self._retry_s if blocked else self._poll_s if holding else None

    def _ship_early(self, now: float) -> tuple[bool, bool]:
        """Hand the sender the rows of rooms whose first images are encoded (begin a room the
        first time); (some wait for blocks, some are begun at the sender)."""
        blocked = begun = False
        for record in self._rooms.partially_encoded():
            task, prompt, room = record.task, record.prompt, record.room
            if task is None or prompt is None or now > record.deadline:
                continue  # the ViT loop or the deadline ends it
            if record.num_rows_shipped >= 0:
                if self._transfer_failed(room):
                    continue
                begun = True
            ready = task.leading_rows()
            num_rows = sum(len(rows) for rows in ready)
            if num_rows <= record.num_rows_shipped:
                continue
            try:
                if record.num_rows_shipped < 0:
                    rows = torch.cat(ready) if ready else None
                    aux = early_aux_info(prompt, task.num_cache_hits)
                    args = (prompt.fill_ids, prompt.positions, aux, prompt.image_mask)
                    if not self.sender.begin(room, *args, image_rows=rows):
                        blocked = True
                        self.num_submit_retries += 1
                        continue
                else:
                    self.sender.add_rows(room, _rows_from(ready, record.num_rows_shipped))
            except Exception as exc:  # a bad room must not stop the others
                logger.exception("early shipping of room %d failed", room)
                self._fail(room, f"submit failed: {exc}")
                continue
            self._rooms.shipped_rows(room, num_rows)
            begun = True
        return blocked, begun

    def _transfer_failed(self, room: int) -> bool:
        """Whether a room begun at the sender failed there (it is then cancelled here)."""
        try:
            failed = self.sender.poll(room) == RoomState.FAILED
        except KeyError:
            failed = True
        if failed and self._on_transfer_failed is not None:
            self._on_transfer_failed(room, "the transfer failed before its last image")
        return failed

    def _submit(self, now: float) -> bool:
        """Hand ENCODED rooms to the sender; True when some still wait for blocks."""
        blocked = False
        for room, encoded, deadline, num_rows_shipped in self._rooms.encoded():
            if now > deadline:
                self._fail(room, "deadline: no transfer blocks were free before it passed")
                continue
            try:
                if num_rows_shipped >= 0:  # begun image by image: the last rows, final metadata
                    rest = encoded.image_rows[num_rows_shipped:]
                    self.sender.add_rows(room, rest, aux_info(encoded))
                    ok = True
                else:
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
                self._fail(room, f"submit failed: {exc}")
                continue
            if not ok:
                blocked = True
                self.num_submit_retries += 1
            else:
                # NOTE: a room failed meanwhile stays FAILED: whoever failed it also fails it at
                # the sender, before or after this submit (the sender drops or frees the data).
                self._rooms.advance(room, RoomStatus.SUBMITTED)
        return blocked

    def _poll(self, now: float) -> bool:
        """Record how submitted rooms ended; True when the sender still holds some."""
        holding = False
        for room, deadline in self._rooms.submitted():
            try:
                state = self.sender.poll(room)
            except KeyError:  # forgotten by the sender: it cannot be delivered any more
                state = RoomState.FAILED
            if state == RoomState.SUCCESS:
                self._rooms.advance(room, RoomStatus.SHIPPED)
            elif state == RoomState.FAILED:
                self._rooms.fail(room, "transfer failed")
            elif now > deadline:
                self._fail(room, "deadline: the transfer had not ended when it passed")
            else:
                holding = True
        return holding

    def _fail(self, room: int, reason: str) -> None:
        if self._rooms.fail(room, reason):
            self.sender.fail(room, reason)


def _rows_from(ready: list[torch.Tensor], start: int) -> torch.Tensor:
    """Rows ``start``.. of the images' rows ``ready`` (in order), without copying the rest."""
    out, at = [], 0
    for rows in ready:
        if at + len(rows) > start:
            out.append(rows[max(0, start - at) :])
        at += len(rows)
    return torch.cat(out)
