"""Book-keeping of one room on the receiver (language) side, and chunk assembly."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .allocator import Allocation
from .aux_record import ChunkInfo
from .buffers import DataBuffers
from .layout import BufferLayout
from .types import AuxInfo, ReceivedEmbeddings, RoomState, advance


@dataclass
class ReceiverRoom:
    room: int
    sender_endpoint: str
    state: RoomState = RoomState.BOOTSTRAPPING
    deadline: float = 0.0
    allocation: Allocation | None = None
    awaiting_write: bool = False  # an init is out: a write into `allocation` may land
    init_sent: bool = False  # the sender knows this room (abort it when we give up)
    received: int = 0  # == sent_tokens of the next init
    num_image_rows_received: int = 0
    num_transfers: int = 0
    first_data_at: float = 0.0  # monotonic time the sender's first write began (about)
    aux: AuxInfo | None = None
    fill_ids: np.ndarray | None = None
    positions: np.ndarray | None = None
    image_rows: torch.Tensor | None = None
    lent: bool = False  # image_rows is a view of `allocation`'s blocks (whole request, one run)

    def move(self, state: RoomState) -> None:
        self.state = advance(self.state, state)

    def check_chunk(self, room: int, aux: AuxInfo, chunk: ChunkInfo, status_tokens: int) -> str:
        """Why the aux record read from our buffer does not fit this room ("" when it does)."""
        capacity = len(self.allocation.block_ids) if self.allocation else 0
        if room != self.room:
            return f"aux_mismatch: record is for room {room}"
        if self.aux is not None and (aux.total_tokens, aux.num_image_rows) != (
            self.aux.total_tokens,
            self.aux.num_image_rows,
        ):
            return "aux_mismatch: request metadata changed between chunks"
        if chunk.chunk_start != self.received or chunk.num_tokens != status_tokens:
            return (
                f"aux_mismatch: chunk [{chunk.chunk_start}, +{chunk.num_tokens}) vs expected "
                f"[{self.received}, +{status_tokens})"
            )
        if chunk.num_tokens <= 0 or chunk.chunk_start + chunk.num_tokens > aux.total_tokens:
            return "aux_mismatch: chunk outside the request"
        if chunk.first_image_row != self.num_image_rows_received:
            return "aux_mismatch: image rows out of order"
        if chunk.num_image_rows > chunk.num_tokens or capacity == 0:
            return "aux_mismatch: chunk does not fit the allocation"
        if chunk.first_image_row + chunk.num_image_rows > aux.num_image_rows:
            return "aux_mismatch: more image rows than announced"
        return ""

    def prepare(self, total_tokens: int, num_image_rows: int, layout: BufferLayout) -> None:
        """Allocate (and fault in) the assembled request's memory ahead of the first chunk.

        NOTE: first-touching fresh memory costs about as much as the copy itself; the sender
        announces the size as its first write starts so this overlaps with the transfer.
        """
        self.fill_ids = np.zeros(total_tokens, dtype=np.int32)
        self.positions = np.zeros((3, total_tokens), dtype=np.int32)
        self.image_rows = torch.zeros((num_image_rows, layout.row_width), dtype=layout.dtype)

    def absorb(self, buffers: DataBuffers, aux: AuxInfo, chunk: ChunkInfo, lend: bool) -> bool:
        """Take a landed chunk out of our blocks; True when its rows stay there (lent).

        With ``lend`` (the caller's word that this chunk is the whole request and that the
        blocks may stay with the result) and the rows in one run of slots, ``image_rows`` is a
        view of the blocks instead of a copy: the caller must keep them allocated until the
        consumer releases the room. Token fields are always copied (a few bytes per token).
        """
        assert self.allocation is not None
        ids = self.allocation.block_ids
        first, k = chunk.first_image_row, chunk.num_image_rows
        start, end = chunk.chunk_start, chunk.chunk_start + chunk.num_tokens
        fill, pos = buffers.read_tokens(ids, chunk.num_tokens)
        view = buffers.row_view(ids, k) if lend and k else None
        if view is not None:
            self.aux = aux
            self.fill_ids = fill.numpy()
            self.positions = np.ascontiguousarray(pos.numpy().T)
            self.image_rows = view
        else:
            if self.aux is None:
                self.aux = aux
                prepared = self.image_rows is not None and self.fill_ids is not None
                if not prepared or (len(self.fill_ids), len(self.image_rows)) != (
                    aux.total_tokens,
                    aux.num_image_rows,
                ):
                    self.prepare(aux.total_tokens, aux.num_image_rows, buffers.layout)
            self.fill_ids[start:end] = fill.numpy()
            self.positions[:, start:end] = pos.numpy().T
            if k:
                buffers.read_rows(ids, k, self.image_rows[first : first + k])
        self.received = end
        self.num_image_rows_received = first + k
        self.num_transfers += 1
        self.lent = view is not None
        return self.lent

    def result(self) -> ReceivedEmbeddings:
        assert self.aux is not None
        return ReceivedEmbeddings(
            fill_ids=self.fill_ids,
            positions=self.positions,
            image_rows=self.image_rows,
            aux=self.aux,
            num_transfers=self.num_transfers,
            lent=self.lent,
            transfer_s=time.monotonic() - self.first_data_at if self.first_data_at else 0.0,
        )
