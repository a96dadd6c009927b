"""Sender-side chunk planning: which tokens and rows a write carries and where they go.

A chunk covers tokens ``[s, s + n)`` with ``n = min(remaining, receiver capacity)``. Its image
rows are those whose token index falls in the chunk: rows ``row_prefix[s] .. row_prefix[s+n]``
of the sender's packed rows. At the destination, token fields go to token slots
``t..t+n-1`` and rows to row slots ``r..r+k-1`` of the receiver's blocks: ``t`` is the init's
``dest_token_offset`` (0 unless a continuation extends the blocks that hold earlier chunks) and
``r`` the image rows among those ``t`` tokens. The aux record goes to the aux slot of the block
that holds the chunk's first token (block ``t // block_size``), so a continuation written before
the receiver read the previous chunk's record does not overwrite it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from protos.epd.v1 import transfer_pb2

from .addressing import pair_runs, slot_runs
from .aux_record import AUX_RECORD_BYTES, ChunkInfo
from .buffers import DataBuffers
from .layout import BufferLayout, dtype_name

# Up to this many tokens a chunk's token fields (16 bytes per token) and aux record ride in its
# status (<= 17.5 KiB) when the transport pays per segment: one segment (the rows) instead of
# four, none for a chunk without image rows.
MAX_INLINE_TOKENS = 1024


class Segments(NamedTuple):
    src_addrs: list[int]
    dst_addrs: list[int]
    lengths: list[int]


def plan_chunk(row_prefix: np.ndarray, sent_tokens: int, capacity: int) -> ChunkInfo:
    """``row_prefix[i]`` = number of image rows before token ``i`` (length total + 1)."""
    total = len(row_prefix) - 1
    num_tokens = min(total - sent_tokens, capacity)
    first_row = int(row_prefix[sent_tokens])
    num_rows = int(row_prefix[sent_tokens + num_tokens]) - first_row
    return ChunkInfo(sent_tokens, num_tokens, first_row, num_rows)


def layout_fields(layout: BufferLayout) -> dict:
    """The ``TransferInit`` fields that describe a receiver's buffers (what
    ``destinations.check_init`` holds against the sender's own layout)."""
    return dict(
        row_bytes=layout.row_bytes,
        hidden_size=layout.hidden_size,
        num_deepstack=layout.num_deepstack,
        dtype=dtype_name(layout.dtype),
        block_size=layout.block_size,
        num_blocks=layout.num_blocks,
        aux_record_bytes=AUX_RECORD_BYTES,
    )


def inline_tokens(init: transfer_pb2.TransferInit, chunk: ChunkInfo) -> bool:
    """Whether the chunk's token fields and aux record may travel in its status (minor 6):
    the receiver takes them, and they stay small (a few KiB: the frame limit is 64 KiB)."""
    return init.accepts_inline and chunk.num_tokens <= MAX_INLINE_TOKENS


def partial_end(chunk_end: int, dest_slot: int, block_size: int) -> int:
    """Where a chunk that stops short of its init (its data is not all ready) must end so that
    the next chunk starts on a destination block boundary: ``chunk_end`` lands at destination
    slot ``dest_slot``; the end moves back to the start of that slot's block."""
    return chunk_end - dest_slot % block_size


def dest_row_offset(
    row_prefix: np.ndarray, init: transfer_pb2.TransferInit, sent_tokens: int | None = None
) -> int:
    """Row slot of the chunk's first image row: the rows of the tokens already in place (the
    chunk starts at ``sent_tokens``, by default the init's)."""
    start = init.sent_tokens if sent_tokens is None else sent_tokens
    return int(row_prefix[start] - row_prefix[init.sent_tokens - init.dest_token_offset])


def build_segments(
    buffers: DataBuffers,
    src_blocks: tuple[int, ...],
    init: transfer_pb2.TransferInit,
    chunk: ChunkInfo,
    rows_at: int,
    aux_len: int,
    tokens_at: int | None = None,
    rows_only: bool = False,
) -> Segments:
    """All segments of one chunk (every field), split where either side stops being contiguous;
    rows land at row slot ``rows_at`` (see ``dest_row_offset``), tokens at token slot
    ``tokens_at`` (by default the init's ``dest_token_offset``). ``rows_only``: the token fields
    and the aux record go inline in the status (see ``inline_tokens``)."""
    dst_blocks = list(init.block_ids)
    src_addrs: list[int] = []
    dst_addrs: list[int] = []
    lengths: list[int] = []

    def add(name: str, dst_base: int, src_offset: int, dst_offset: int, count: int) -> None:
        if count == 0:
            return
        width = buffers.slot_bytes[name]
        src_base = buffers.base(name)
        src_runs = buffers.runs(src_blocks, src_offset, count)
        dst_runs = slot_runs(dst_blocks, init.block_size, dst_offset, count)
        for s, d, n in pair_runs(src_runs, dst_runs):
            src_addrs.append(src_base + s * width)
            dst_addrs.append(dst_base + d * width)
            lengths.append(n * width)

    if tokens_at is None:
        tokens_at = init.dest_token_offset
    add("rows", init.rows.base, chunk.first_image_row, rows_at, chunk.num_image_rows)
    if rows_only:
        return Segments(src_addrs, dst_addrs, lengths)
    add("fill_ids", init.fill_ids.base, chunk.chunk_start, tokens_at, chunk.num_tokens)
    add("positions", init.positions.base, chunk.chunk_start, tokens_at, chunk.num_tokens)
    src_addrs.append(buffers.base("aux") + src_blocks[0] * buffers.slot_bytes["aux"])
    aux_block = dst_blocks[tokens_at // init.block_size]  # holds the first token
    dst_addrs.append(init.aux.base + aux_block * init.aux_record_bytes)
    lengths.append(aux_len)
    return Segments(src_addrs, dst_addrs, lengths)
