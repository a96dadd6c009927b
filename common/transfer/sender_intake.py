"""The sender's data intake: a room's tokens and rows, whole or image by image.

``submit`` takes a whole request; ``begin`` takes its tokens and the rows ready so far and
``add_rows`` the next ones as the encoder produces them. The tokens are copied into our blocks
at once, the rows as they come; every time more is ready the room's next chunk may go
(``SenderWrites._maybe_write``). ``EmbeddingSender`` (``sender.py``) holds the room flow.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .sender_room import SenderRoom, image_row_prefix
from .sender_writes import SenderWrites
from .types import AuxInfo


class SenderIntake(SenderWrites):
    """Data intake of an ``EmbeddingSender``."""

    def submit(
        self,
        room: int,
        fill_ids: np.ndarray,
        positions: np.ndarray,
        image_rows: torch.Tensor,
        aux: AuxInfo,
        image_mask: np.ndarray | None = None,
    ) -> bool:
        """Data for ``room`` is ready; False (nothing kept) when blocks are short.

        ``image_mask`` (bool ``[total_tokens]``) marks the image tokens, whose rows are
        ``image_rows`` in token order; it may be omitted when every token is an image token.
        Data of a room that failed or was cancelled meanwhile is dropped (True).
        """
        if tuple(image_rows.shape[:1]) != (aux.num_image_rows,):
            raise ValueError(f"image_rows has {len(image_rows)} rows, aux {aux.num_image_rows}")
        return self.begin(room, fill_ids, positions, aux, image_mask, image_rows)

    def begin(
        self,
        room: int,
        fill_ids: np.ndarray,
        positions: np.ndarray,
        aux: AuxInfo,
        image_mask: np.ndarray | None = None,
        image_rows: torch.Tensor | None = None,
    ) -> bool:
        """The room's tokens are known and its first ``image_rows`` (in token order; None:
        none yet) are ready; ``add_rows`` brings the rest. False (nothing kept) when blocks are
        short. Chunks go out as the rows come: a receiver that accepts partial chunks gets the
        tokens whose rows are there (to whole destination blocks) without waiting for the rest.
        Data of a room that failed or was cancelled meanwhile is dropped (True).
        """
        fill_ids, positions = np.asarray(fill_ids), np.asarray(positions)  # torch CPU ok too
        if image_rows is None:
            image_rows = torch.empty(0, self.layout.row_width)
        mask = self._check_inputs(fill_ids, positions, image_rows, aux, image_mask)
        with self._lock:
            if room in self._finished:
                self.counters["discarded_late_submits"] += 1
                return True
            existing = self._rooms.get(room)
            if existing is not None and existing.has_data:
                raise ValueError(f"room {room} was already submitted")
            allocation = self.allocator.alloc(aux.total_tokens)
            if allocation is None:
                return False
        self.buffers.write_tokens(allocation.block_ids, fill_ids, positions, image_rows)
        with self._lock:
            state = self._rooms.get(room)
            if state is None and room in self._finished:  # failed meanwhile
                self.allocator.free(allocation)
                self.counters["discarded_late_submits"] += 1
                return True
            if state is None:
                state = self._rooms[room] = SenderRoom(room)
                self._arm(state, time.monotonic())
            state.allocation, state.aux, state.row_prefix = allocation, aux, image_row_prefix(mask)
            state.num_rows_ready = len(image_rows)
            self._maybe_write(state)
        self._wake()
        return True

    def add_rows(self, room: int, image_rows: torch.Tensor, aux: AuxInfo | None = None) -> None:
        """The next ``image_rows`` of a room begun with ``begin`` (in token order); ``aux``, when
        given, replaces the room's metadata for the chunks still to go (same token and row
        counts: e.g. the encoder's final timings). Rows of a room that failed are dropped."""
        with self._lock:
            if room in self._finished:
                self.counters["discarded_late_submits"] += 1
                return
            state = self._rooms.get(room)
            if state is None or not state.has_data:
                raise ValueError(f"room {room} was not begun")
            num_rows = state.num_rows_ready + len(image_rows)
            if num_rows > state.aux.num_image_rows or (
                len(image_rows) and tuple(image_rows.shape[1:]) != (self.layout.row_width,)
            ):
                raise ValueError(
                    f"{tuple(image_rows.shape)} more rows after {state.num_rows_ready} do not "
                    f"fit {state.aux.num_image_rows} rows of width {self.layout.row_width}"
                )
            if aux is not None:
                if (aux.total_tokens, aux.num_image_rows) != (
                    state.aux.total_tokens,
                    state.aux.num_image_rows,
                ):
                    raise ValueError("aux changed the room's token or row count")
                state.aux = aux
            # under the lock: a failure cannot free the blocks while they are being filled
            self.buffers.write_rows(state.allocation.block_ids, state.num_rows_ready, image_rows)
            state.num_rows_ready = num_rows
            self._maybe_write(state)
        self._wake()

    def _check_inputs(
        self,
        fill_ids: np.ndarray,
        positions: np.ndarray,
        image_rows: torch.Tensor,
        aux: AuxInfo,
        image_mask: np.ndarray | None,
    ) -> np.ndarray:
        """Validate a submit; returns the image-token mask."""
        total = aux.total_tokens
        if fill_ids.shape != (total,) or positions.shape != (3, total):
            raise ValueError(
                f"fill_ids {fill_ids.shape} / positions {positions.shape} do not match "
                f"total_tokens {total}"
            )
        # Rows may come in any float dtype (the encoder's compute dtype): they are cast to the
        # layout's wire dtype as they are written into the blocks. ``begin`` may bring only the
        # first ones.
        shape = tuple(image_rows.shape)
        fits = len(shape) == 2 and shape[0] <= aux.num_image_rows
        if not fits or shape[1] != self.layout.row_width or not image_rows.dtype.is_floating_point:
            raise ValueError(
                f"image_rows {shape} {image_rows.dtype}, expected "
                f"({aux.num_image_rows}, {self.layout.row_width}) of a float dtype"
            )
        if image_mask is None:
            if aux.num_image_rows != total:
                raise ValueError("image_mask is required unless every token is an image token")
            return np.ones(total, dtype=bool)
        mask = np.asarray(image_mask, dtype=bool)
        if mask.shape != (total,) or int(mask.sum()) != aux.num_image_rows:
            raise ValueError("image_mask must have total_tokens entries, num_image_rows set")
        return mask
