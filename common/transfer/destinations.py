"""Checks of an init's destinations before the sender writes a byte.

An init describes the receiver's buffers (region addresses and sizes, geometry) and names the
blocks to write. The sender trusts none of it: ``check_init`` returns why an init cannot be
served, as a ``(FailureKind, detail)`` pair, or None:

- the row layout (hidden size, deepstack rows, dtype, row bytes) must equal ours
  (``LAYOUT_MISMATCH``);
- the geometry must be sane and every block id must exist in it (``num_blocks``), at most
  ``MAX_INIT_BLOCKS`` of them, no id twice; the tokens asked for must fit the blocks behind
  ``dest_token_offset`` (``BAD_INIT``);
- each region's size must be exactly what that geometry needs (rows: slots x row bytes,
  fill ids: slots x 4, positions: slots x 12, aux: blocks x record bytes), the regions must not
  overlap nor wrap around the address space;
- shared memory: all four regions or none name a file, each name follows the project's region
  naming for its field (``epd-transfer-<pid>-<12 hex>-<field>``). ``regions.map_peer_region``
  also requires the file to be a regular file of exactly the advertised size.

Mooncake itself refuses to write anywhere the receiver did not register, so an init whose
addresses are well-formed but point at other memory fails at the write (``WRITE_FAILED``)
with nothing written; see docs/protocol.md.
"""

from __future__ import annotations

from protos.epd.v1 import transfer_pb2

from .aux_record import AUX_HEADER_BYTES
from .control import MAX_INIT_BLOCKS
from .layout import BufferLayout, dtype_name
from .regions import valid_shm_name
from .types import MAX_EXTRA_BYTES, FailureKind

FIELDS = ("rows", "fill_ids", "positions", "aux")
_ADDRESS_SPACE = 1 << 64

Problem = tuple[FailureKind, str]  # the kind, and the detail that follows its label


def _bad(detail: str) -> Problem:
    return FailureKind.BAD_INIT, detail


def region_sizes(init: transfer_pb2.TransferInit) -> dict[str, int]:
    """The byte size each region of the init's geometry must have."""
    slots = init.num_blocks * init.block_size
    return {
        "rows": slots * init.row_bytes,
        "fill_ids": slots * 4,
        "positions": slots * 12,
        "aux": init.num_blocks * init.aux_record_bytes,
    }


def check_init(init: transfer_pb2.TransferInit, layout: BufferLayout) -> Problem | None:
    """Why the init's destinations cannot take our rows; None when they can."""
    ours = (layout.hidden_size, layout.num_deepstack, dtype_name(layout.dtype), layout.row_bytes)
    theirs = (init.hidden_size, init.num_deepstack, init.dtype, init.row_bytes)
    if ours != theirs:
        return FailureKind.LAYOUT_MISMATCH, (
            f"receiver hidden={theirs[0]} deepstack={theirs[1]} dtype={theirs[2][:32]} "
            f"row_bytes={theirs[3]}, sender {layout.describe()}"
        )
    return _check_geometry(init) or _check_regions(init)


def _check_geometry(init: transfer_pb2.TransferInit) -> Problem | None:
    if init.block_size <= 0 or init.num_blocks <= 0:
        return _bad(f"geometry {init.num_blocks} blocks x {init.block_size} tokens")
    if init.aux_record_bytes < AUX_HEADER_BYTES + MAX_EXTRA_BYTES:
        return _bad(f"aux records of {init.aux_record_bytes} bytes are too small")
    ids = init.block_ids
    if not ids or len(ids) > MAX_INIT_BLOCKS:
        return _bad(f"{len(ids)} destination blocks (1..{MAX_INIT_BLOCKS})")
    if max(ids) >= init.num_blocks:
        return _bad(f"block id {max(ids)} outside the receiver's {init.num_blocks} blocks")
    if len(set(ids)) != len(ids):
        return _bad("a destination block is listed twice")
    if init.num_tokens_allocated <= 0:
        return _bad("no tokens allocated")
    capacity = len(ids) * init.block_size
    if init.dest_token_offset + init.num_tokens_allocated > capacity:
        return _bad(
            f"{init.dest_token_offset} tokens in place + {init.num_tokens_allocated} allocated "
            f"exceed the {capacity} token slots of the destination blocks"
        )
    if init.dest_token_offset > init.sent_tokens:
        return _bad("more tokens in place than were sent")
    return None


def _check_regions(init: transfer_pb2.TransferInit) -> Problem | None:
    sizes = region_sizes(init)
    spans = []
    for name in FIELDS:
        region = getattr(init, name)
        if region.nbytes != sizes[name]:
            return _bad(
                f"{name} region of {region.nbytes} bytes; the receiver's geometry needs "
                f"{sizes[name]}"
            )
        if region.base <= 0 or region.base + region.nbytes > _ADDRESS_SPACE:
            return _bad(f"{name} region at {region.base:#x} is outside the address space")
        spans.append((region.base, region.base + region.nbytes, name))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
        if start < end:
            return _bad(f"{first} and {second} regions overlap")
    named = [name for name in FIELDS if getattr(init, name).shm_name]
    if named and len(named) != len(FIELDS):
        return _bad("shared memory for some regions only")
    for name in named:
        if not valid_shm_name(getattr(init, name).shm_name, name):
            return _bad(f"{name} region names {getattr(init, name).shm_name[:80]!r}, not a region")
    return None
