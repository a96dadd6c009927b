"""Writing weights as Hub-style safetensors shards without holding the model in memory.

The tensors to write are known by name, shape and dtype before any of them exists, so each
shard's header is written first and each tensor's bytes are streamed after it, chunk by chunk,
from a ``fill`` callback. Memory stays at one chunk whatever the model's size.

Layout (what ``save_pretrained`` produces): one ``model.safetensors`` when everything fits in
one shard, else ``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_bytes`` each
(a larger tensor gets a shard of its own) plus ``model.safetensors.index.json`` with
``metadata.total_size`` and the ``weight_map``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from common.models.checkpoint_files import DTYPE_NAMES, WEIGHTS_INDEX


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its checkpoint key, shape and dtype."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


Fill = Callable[[TensorSpec], Iterable[torch.Tensor]]


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive groups of ``specs`` of at most ``max_shard_bytes`` each (order kept)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards if shards[0] else []


def shard_names(num_shards: int) -> list[str]:
    if num_shards == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)]


def _header(specs: list[TensorSpec]) -> bytes:
    """The safetensors header (length prefix included), padded to 8 bytes."""
    meta: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        meta[spec.key] = {
            "dtype": DTYPE_NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    body = json.dumps(meta, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


def _write_shard(file: Path, specs: list[TensorSpec], fill: Fill) -> None:
    with open(file, "wb") as out:
        out.write(_header(specs))
        for spec in specs:
            written = 0
            for chunk in fill(spec):
                if chunk.dtype != spec.dtype:
                    raise TypeError(f"{spec.key}: fill gave {chunk.dtype}, expected {spec.dtype}")
                data = chunk.contiguous().view(-1).view(torch.uint8).numpy()
                out.write(memoryview(data))
                written += data.nbytes
            if written != spec.nbytes:
                raise ValueError(f"{spec.key}: fill gave {written} bytes, expected {spec.nbytes}")


def write_shards(
    out_dir: str | Path, specs: list[TensorSpec], fill: Fill, max_shard_bytes: int
) -> list[Path]:
    """Write ``specs`` into ``out_dir`` as shards (+ index when more than one); returns the files.

    Within a shard, tensors are stored widest dtype first so every tensor is aligned to its
    element size (what lets readers map them without copying).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = [spec.key for spec in specs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate tensor keys")
    groups = plan_shards(specs, max_shard_bytes)
    if not groups:
        raise ValueError("no tensors to write")
    names = shard_names(len(groups))
    weight_map: dict[str, str] = {}
    for name, group in zip(names, groups, strict=True):
        ordered = sorted(group, key=lambda s: -s.itemsize)  # stable: keeps order within a width
        _write_shard(out_dir / name, ordered, fill)
        weight_map.update((spec.key, name) for spec in group)
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(spec.nbytes for spec in specs)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out_dir / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [out_dir / name for name in names]


def chunked_rows(spec: TensorSpec, max_chunk_numel: int) -> Iterator[tuple[int, int]]:
    """``(first_row, num_rows)`` pieces of ``spec`` along dim 0, each under ``max_chunk_numel``
    elements (at least one row)."""
    rows = spec.shape[0] if spec.shape else 1
    row_numel = spec.numel // rows if rows else 0
    step = max(1, max_chunk_numel // max(row_numel, 1))
    for first in range(0, rows, step):
        yield first, min(step, rows - first)
