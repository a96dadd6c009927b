"""Book-keeping of one room on the receiver (language) side, and chunk assembly."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from .allocator import Allocation
from .aux_record import ChunkInfo
from .buffers import DataBuffers
from .layout import BufferLayout
from .types import AuxInfo, FailureKind, ReceivedChunk, ReceivedEmbeddings, RoomState, advance


@dataclass
class ReceiverRoom:
    room: int
    sender_endpoint: str
    state: RoomState = RoomState.BOOTSTRAPPING
    deadline: float = math.inf  # the current state's timeout (monotonic)
    request_deadline: float = math.inf  # the request's own deadline (monotonic)
    allocation: Allocation | None = None
    awaiting_write: bool = False  # an init is out: a write into `allocation` may land
    known_to_sender: bool = False  # an init or a claim went out: abort it when we give up
    acked: bool = False  # the sender holds our first init for the data ("still encoding")
    sender_incarnation: int = 0  # the sender process that answered for the room (0: none yet)
    kind: FailureKind = FailureKind.UNSPECIFIED
    received: int = 0  # == sent_tokens of the next init
    num_image_rows_received: int = 0
    # `allocation` holds tokens [held_start, received) at token slots 0.. and image rows
    # [held_row_start, num_image_rows_received) at row slots 0..; earlier ones were copied out
    held_start: int = 0
    held_row_start: int = 0
    sender_minor: int = 0  # the sender's protocol minor version, from its statuses
    continuation_at: int = 0  # a continuation init from this token is out before it landed
    num_transfers: int = 0
    first_data_at: float = 0.0  # monotonic time the sender's first write began (about)
    aux: AuxInfo | None = None
    fill_ids: np.ndarray | None = None
    positions: np.ndarray | None = None
    image_rows: torch.Tensor | None = None
    lent: bool = False  # image_rows is a view of receive blocks (whole request, one run)

    def move(self, state: RoomState) -> None:
        self.state = advance(self.state, state)

    def check_chunk(self, room: int, aux: AuxInfo, chunk: ChunkInfo, status_tokens: int) -> str:
        """Why the aux record read from our buffer does not fit this room ("" when it does);
        the caller fails the room with ``AUX_MISMATCH`` and this detail."""
        capacity = len(self.allocation.block_ids) if self.allocation else 0
        if room != self.room:
            return f"record is for room {room}"
        if self.aux is not None and (aux.total_tokens, aux.num_image_rows) != (
            self.aux.total_tokens,
            self.aux.num_image_rows,
        ):
            return "request metadata changed between chunks"
        if chunk.chunk_start != self.received or chunk.num_tokens != status_tokens:
            return (
                f"chunk [{chunk.chunk_start}, +{chunk.num_tokens}) vs expected "
                f"[{self.received}, +{status_tokens})"
            )
        if chunk.num_tokens <= 0 or chunk.chunk_start + chunk.num_tokens > aux.total_tokens:
            return "chunk outside the request"
        if chunk.first_image_row != self.num_image_rows_received:
            return "image rows out of order"
        if chunk.num_image_rows > chunk.num_tokens or capacity == 0:
            return "chunk does not fit the allocation"
        if chunk.first_image_row + chunk.num_image_rows > aux.num_image_rows:
            return "more image rows than announced"
        return ""

    def prepare(self, total_tokens: int, num_image_rows: int, layout: BufferLayout) -> None:
        """Allocate (and fault in) the assembled request's memory for ``copy_out``.

        NOTE: first-touching fresh memory costs about as much as the copy itself; the sender
        announces the size as its first write starts so this can overlap with the transfer.
        """
        self.fill_ids = np.zeros(total_tokens, dtype=np.int32)
        self.positions = np.zeros((3, total_tokens), dtype=np.int32)
        self.image_rows = torch.zeros((num_image_rows, layout.row_width), dtype=layout.dtype)

    @property
    def num_tokens_in_place(self) -> int:
        """Tokens of the room that sit in ``allocation`` (the next chunk lands behind them)."""
        return self.received - self.held_start

    @property
    def holds_whole_prefix(self) -> bool:
        """Everything received so far sits in ``allocation`` (nothing was copied out)."""
        return self.held_start == 0

    def land(self, aux: AuxInfo, chunk: ChunkInfo) -> None:
        """Book a chunk that landed in ``allocation`` behind what was there (nothing is copied).
        The latest chunk's metadata is kept (a sender shipping image by image knows its
        timings only at the end)."""
        self.aux = aux
        self.received = chunk.chunk_start + chunk.num_tokens
        self.num_image_rows_received = chunk.first_image_row + chunk.num_image_rows
        self.num_transfers += 1

    def read_chunk(self, buffers: DataBuffers, chunk: ChunkInfo) -> ReceivedChunk:
        """Copies of a chunk that just landed in ``allocation`` (before anything moves it)."""
        assert self.allocation is not None and self.aux is not None
        ids = self.allocation.block_ids
        fill, pos = buffers.read_tokens(ids, chunk.num_tokens, chunk.chunk_start - self.held_start)
        rows = torch.empty(
            (chunk.num_image_rows, buffers.layout.row_width), dtype=buffers.layout.dtype
        )
        if chunk.num_image_rows:
            row_slot = chunk.first_image_row - self.held_row_start
            buffers.read_rows(ids, chunk.num_image_rows, rows, row_slot)
        return ReceivedChunk(chunk.chunk_start, fill, pos, rows, self.aux)

    def copy_out(self, buffers: DataBuffers) -> None:
        """Copy what ``allocation`` holds into the assembled request; the caller frees it."""
        assert self.allocation is not None and self.aux is not None
        total, num_rows = self.aux.total_tokens, self.aux.num_image_rows
        if self.fill_ids is None or (len(self.fill_ids), len(self.image_rows)) != (total, num_rows):
            self.prepare(total, num_rows, buffers.layout)
        ids = self.allocation.block_ids
        start, first = self.held_start, self.held_row_start
        fill, pos = buffers.read_tokens(ids, self.received - start)
        self.fill_ids[start : self.received] = fill
        self.positions[:, start : self.received] = pos
        if self.num_image_rows_received > first:
            rows = self.image_rows[first : self.num_image_rows_received]
            buffers.read_rows(ids, len(rows), rows)
        self.held_start, self.held_row_start = self.received, self.num_image_rows_received

    def lend_in_place(self, buffers: DataBuffers) -> bool:
        """Deliver a whole room that sits in ``allocation`` with ``image_rows`` as a view of its
        blocks; False (nothing changed) when its rows are not one run of slots.

        The caller keeps the blocks allocated until the consumer releases the room. Token
        fields are copied (a few bytes per token).
        """
        assert self.allocation is not None and self.aux is not None and self.holds_whole_prefix
        ids, num_rows = self.allocation.block_ids, self.num_image_rows_received
        view = buffers.row_view(ids, num_rows) if num_rows else None
        if view is None:
            return False
        self.fill_ids, self.positions = buffers.read_tokens(ids, self.received)
        self.image_rows = view
        self.lent = True
        return True

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
