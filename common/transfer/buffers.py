"""The transfer buffers: one registered region per field, addressed by token slot.

=============  ==========================  =====================
region         per slot                    dtype
=============  ==========================  =====================
rows           one image row (row_width)   layout dtype
fill_ids       one token id                int32
positions      3 M-RoPE position ids       int32
aux            one record per *block*      AUX_RECORD_BYTES raw
=============  ==========================  =====================

Token fields of an allocation sit at token slots 0..n-1; its image rows are packed at row
slots 0..k-1 of the same blocks (k <= n); its aux record is at the block holding its first token.

Token fields and aux records are handled as numpy views, rows as a torch view (the rows are
what the model consumes). NOTE: right after a transfer has swept the CPU caches, a torch
indexing op costs ~10x its numpy counterpart (65 vs 6 us); these run on every chunk.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from .addressing import slot_runs
from .aux_record import AUX_RECORD_BYTES
from .layout import BufferLayout
from .regions import Region, allocate_region, sweep_stale_regions

FIELDS = ("rows", "fill_ids", "positions", "aux")


class DataBuffers:
    def __init__(self, layout: BufferLayout, shared: bool) -> None:
        self.layout = layout
        slots = layout.num_slots
        self.slot_bytes = {
            "rows": layout.row_bytes,
            "fill_ids": 4,
            "positions": 12,
            "aux": AUX_RECORD_BYTES,  # per block, not per slot
        }
        sizes = {
            "rows": slots * layout.row_bytes,
            "fill_ids": slots * 4,
            "positions": slots * 12,
            "aux": layout.num_blocks * AUX_RECORD_BYTES,
        }
        self.regions: dict[str, Region] = {}
        if shared:
            sweep_stale_regions()
        try:
            for name in FIELDS:
                self.regions[name] = allocate_region(sizes[name], name, shared)
        except BaseException:
            self.close()
            raise
        self.rows = self.regions["rows"].data.view(layout.dtype).view(slots, layout.row_width)
        self.fill_ids = self.regions["fill_ids"].data.numpy().view(np.int32)
        self.positions = self.regions["positions"].data.numpy().view(np.int32).reshape(slots, 3)
        self.aux = self.regions["aux"].data.numpy().reshape(layout.num_blocks, AUX_RECORD_BYTES)

    def runs(self, block_ids: Sequence[int], offset: int, count: int) -> list[tuple[int, int]]:
        return slot_runs(block_ids, self.layout.block_size, offset, count)

    def write_tokens(
        self,
        block_ids: Sequence[int],
        fill_ids: np.ndarray,
        positions: np.ndarray,
        image_rows: torch.Tensor,
    ) -> None:
        """Store a whole request at slots 0.. of ``block_ids`` (rows packed at row slots 0..);
        ``positions`` is ``[3, total]``."""
        runs = self.runs(block_ids, 0, len(fill_ids))
        pos = np.asarray(positions).T
        token = 0
        for slot, length in runs:
            self.fill_ids[slot : slot + length] = fill_ids[token : token + length]
            self.positions[slot : slot + length] = pos[token : token + length]
            token += length
        self.write_rows(block_ids, 0, image_rows)

    def write_rows(self, block_ids: Sequence[int], first_row: int, rows: torch.Tensor) -> None:
        """Store ``rows`` at row slots ``first_row``.. of ``block_ids``."""
        if len(rows):
            _scatter(self.rows, self.runs(block_ids, first_row, len(rows)), rows)

    def read_tokens(
        self, block_ids: Sequence[int], count: int, offset: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Copies of (fill ids ``[count]``, positions ``[3, count]``) from slots
        ``offset..offset+count-1``."""
        runs = self.runs(block_ids, offset, count) or [(0, 0)]
        fill = np.concatenate([self.fill_ids[s : s + n] for s, n in runs])
        pos = np.concatenate([self.positions[s : s + n] for s, n in runs])
        return fill, np.ascontiguousarray(pos.T)

    def read_rows(
        self, block_ids: Sequence[int], count: int, out: torch.Tensor, offset: int = 0
    ) -> None:
        """Copy row slots ``offset..offset+count-1`` into ``out`` (contiguous
        ``[count, row_width]``)."""
        _gather_into(self.rows, self.runs(block_ids, offset, count), out)

    def row_view(self, block_ids: Sequence[int], count: int) -> torch.Tensor | None:
        """Row slots 0..count-1 as one view into the buffer, or None when they are not one run.

        The view aliases the blocks: it is valid only while they stay allocated to the caller.
        """
        runs = self.runs(block_ids, 0, count)
        if len(runs) != 1:
            return None
        slot, length = runs[0]
        return self.rows[slot : slot + length]

    def token_bytes(self, block_ids: Sequence[int], offset: int, count: int) -> tuple[bytes, bytes]:
        """The raw bytes of slots ``offset..offset+count-1``: (fill ids, positions), as stored
        (int32; positions slot-major, ``t h w`` per slot)."""
        runs = self.runs(block_ids, offset, count)
        fill = b"".join(self.fill_ids[s : s + n].tobytes() for s, n in runs)
        return fill, b"".join(self.positions[s : s + n].tobytes() for s, n in runs)

    def put_token_bytes(
        self, block_ids: Sequence[int], offset: int, fill_ids: bytes, positions: bytes
    ) -> None:
        """Store what ``token_bytes`` returned at slots ``offset..`` of ``block_ids``."""
        fill = np.frombuffer(fill_ids, dtype=np.int32)
        pos = np.frombuffer(positions, dtype=np.int32).reshape(-1, 3)
        token = 0
        for slot, length in self.runs(block_ids, offset, len(fill)):
            self.fill_ids[slot : slot + length] = fill[token : token + length]
            self.positions[slot : slot + length] = pos[token : token + length]
            token += length

    def aux_bytes(self, block_id: int) -> bytes:
        return self.aux[block_id].tobytes()

    def set_aux(self, block_id: int, record: bytes) -> None:
        if len(record) > AUX_RECORD_BYTES:
            raise ValueError(f"aux record of {len(record)} bytes exceeds {AUX_RECORD_BYTES}")
        self.aux[block_id, : len(record)] = np.frombuffer(record, dtype=np.uint8)

    def base(self, name: str) -> int:
        return self.regions[name].base

    def close(self) -> None:
        for region in self.regions.values():
            region.close()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Byte copy between same-shaped tensors.

    NOTE: ``Tensor.copy_`` of bf16 runs ~8x slower than memcpy here; plain memmove (which
    also releases the GIL) is used whenever both sides are contiguous and of one dtype.
    """
    same_layout = dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous()
    if same_layout and src.device.type == "cpu" and dst.device.type == "cpu":
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    else:
        dst.copy_(src)


def _scatter(dst: torch.Tensor, runs: list[tuple[int, int]], src: torch.Tensor) -> None:
    src = src.contiguous()
    pos = 0
    for slot, length in runs:
        _copy(dst[slot : slot + length], src[pos : pos + length])
        pos += length


def _gather_into(src: torch.Tensor, runs: list[tuple[int, int]], out: torch.Tensor) -> None:
    pos = 0
    for slot, length in runs:
        _copy(out[pos : pos + length], src[slot : slot + length])
        pos += length
