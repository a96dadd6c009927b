"""Token slot arithmetic: (allocation, token offset, max tokens) -> contiguous slot runs.

Token ``i`` of an allocation with blocks ``b0, b1, ...`` lives at buffer slot
``b[i // block_size] * block_size + i % block_size``. Example with block_size 4:

    block_ids (7, 8, 2)   offset 2, count 8
    tokens 2..3 -> slots 30..31 | tokens 4..7 -> 32..35 | tokens 8..9 -> 8..9
    runs: (30, 6) (8, 2)     (blocks 7 and 8 are adjacent, so their runs merge)
"""

from __future__ import annotations

from collections.abc import Sequence


def slot_runs(
    block_ids: Sequence[int], block_size: int, offset: int, count: int
) -> list[tuple[int, int]]:
    """Runs ``(first_slot, length)`` covering tokens ``[offset, offset + count)``."""
    end = offset + count
    if offset < 0 or count < 0 or end > len(block_ids) * block_size:
        raise ValueError(
            f"tokens [{offset}, {end}) exceed the allocation ({len(block_ids)} blocks)"
        )
    runs: list[tuple[int, int]] = []
    i = offset
    while i < end:
        b = i // block_size
        first_slot = block_ids[b] * block_size + i % block_size
        length = block_size - i % block_size
        while b + 1 < len(block_ids) and block_ids[b + 1] == block_ids[b] + 1 and i + length < end:
            b += 1
            length += block_size
        length = min(length, end - i)
        runs.append((first_slot, length))
        i += length
    return runs


def pair_runs(
    src: Sequence[tuple[int, int]], dst: Sequence[tuple[int, int]]
) -> list[tuple[int, int, int]]:
    """Split two run lists of equal total length into ``(src_slot, dst_slot, length)``."""
    out: list[tuple[int, int, int]] = []
    si = di = s_off = d_off = 0
    while si < len(src) and di < len(dst):
        s_slot, s_len = src[si]
        d_slot, d_len = dst[di]
        n = min(s_len - s_off, d_len - d_off)
        out.append((s_slot + s_off, d_slot + d_off, n))
        s_off += n
        d_off += n
        if s_off == s_len:
            si, s_off = si + 1, 0
        if d_off == d_len:
            di, d_off = di + 1, 0
    if si != len(src) or di != len(dst):
        raise ValueError("run lists cover different numbers of slots")
    return out
