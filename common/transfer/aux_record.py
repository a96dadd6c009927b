"""The aux record: one fixed-size binary record per block, used at an allocation's first block.

The sender fills it with the request metadata plus the bookkeeping of the chunk it is writing
and ships it in the same batched write as the chunk; the receiver reads it from its own buffer
and cross-checks it against the status message.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .types import MAX_EXTRA_BYTES, AuxInfo

AUX_MAGIC = 0x45504441  # "EPDA"
_HEADER = struct.Struct("<IIQqqqqqqqqqI")  # magic, version, room, 9 x int64, extra_len
AUX_HEADER_BYTES = _HEADER.size
AUX_RECORD_BYTES = 1152  # header + MAX_EXTRA_BYTES, rounded up to 128
assert AUX_HEADER_BYTES + MAX_EXTRA_BYTES <= AUX_RECORD_BYTES


@dataclass(frozen=True)
class ChunkInfo:
    """Which slice of the request a chunk carries."""

    chunk_start: int  # first token index
    num_tokens: int  # tokens in the chunk
    first_image_row: int  # index (among the request's image rows) of the chunk's first row
    num_image_rows: int  # image rows in the chunk


def pack(room: int, aux: AuxInfo, chunk: ChunkInfo) -> bytes:
    """The record's bytes (header + extra; the rest of the slot is left untouched)."""
    header = _HEADER.pack(
        AUX_MAGIC,
        1,
        room,
        aux.total_tokens,
        aux.num_image_rows,
        aux.mrope_delta,
        aux.num_items,
        chunk.chunk_start,
        chunk.num_tokens,
        chunk.first_image_row,
        chunk.num_image_rows,
        0,
        len(aux.extra),
    )
    return header + aux.extra


def unpack(record: bytes) -> tuple[int, AuxInfo, ChunkInfo]:
    """Inverse of ``pack``; raises ValueError on a record that is not one."""
    fields = _HEADER.unpack_from(record)
    magic, _, room, total, num_rows, delta, num_items, start, num_tokens, first_row = fields[:10]
    chunk_rows, extra_len = fields[10], fields[12]
    if magic != AUX_MAGIC or extra_len > MAX_EXTRA_BYTES:
        raise ValueError("not an aux record")
    extra = bytes(record[AUX_HEADER_BYTES : AUX_HEADER_BYTES + extra_len])
    aux = AuxInfo(total, num_rows, delta, num_items, extra)
    return room, aux, ChunkInfo(start, num_tokens, first_row, chunk_rows)
