"""Reading a checkpoint's safetensors weights the way the Hub lays them out.

A checkpoint directory holds either one or more ``*.safetensors`` files, or shards named by
``model.safetensors.index.json`` (``{"weight_map": {key: file}}``). With an index, exactly the
files it names are read and every key it maps must be in its file; other ``*.safetensors``
files in the directory are ignored. A shard the index names but the directory lacks is a
``FileNotFoundError`` naming it.

Tensors come out as zero-copy views of a private memory map of their file: nothing is read
until a tensor's bytes are touched, a tensor costs no anonymous memory of its own, and the
mapping goes away with the last view of its file (or a tensor's pages at once, on request).
Callers copy what they keep; ``copy_into`` copies a model's weights in place, converting the dtype
on the way, while holding one stored tensor at a time. Safetensors data is little-endian, as is
every host this runs on.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

WEIGHTS_INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own bound

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are in its file."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(file: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, by key (``ValueError`` when it is malformed)."""
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{file}: not a safetensors file (shorter than 8 bytes)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise ValueError(f"{file}: header of {header_len} bytes exceeds {MAX_HEADER_BYTES}")
        try:
            header = json.loads(handle.read(header_len))
        except ValueError as exc:
            raise ValueError(f"{file}: unreadable safetensors header ({exc})") from None
    size = file.stat().st_size
    base = 8 + header_len
    entries = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(meta.get("dtype"))
        if dtype is None:
            raise ValueError(f"{file}: tensor {key!r} has unsupported dtype {meta.get('dtype')!r}")
        begin, end = meta["data_offsets"]
        shape = tuple(meta["shape"])
        numel = 1
        for dim in shape:
            numel *= dim
        entry = TensorEntry(key, dtype, shape, base + begin, base + end)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if entry.nbytes != numel * itemsize or entry.end > size or begin < 0:
            raise ValueError(f"{file}: tensor {key!r} has inconsistent offsets {begin}..{end}")
        entries[key] = entry
    return entries


def checkpoint_shards(path: str | Path) -> dict[Path, list[str]]:
    """Each weight file of the checkpoint and the keys to read from it, in file order.

    With an index: the files and keys it names (a missing shard or a key absent from its shard
    is an error). Without: every ``*.safetensors`` file and all of its keys.
    """
    path = Path(path)
    index = path / WEIGHTS_INDEX
    if not index.exists():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors weights in {path}")
        shards = {file: list(read_header(file)) for file in files}
        seen: dict[str, Path] = {}
        for file, keys in shards.items():
            for key in keys:
                if key in seen:
                    raise ValueError(f"{key!r} is in both {seen[key].name} and {file.name}")
                seen[key] = file
        return shards
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{index}: not a safetensors index ({exc!r})") from None
    shards: dict[Path, list[str]] = {}
    for key, name in weight_map.items():
        shards.setdefault(path / name, []).append(key)
    missing = [file.name for file in shards if not file.exists()]
    if missing:
        raise FileNotFoundError(
            f"{index.name} names shard(s) missing from {path}: {', '.join(sorted(missing))}"
        )
    if not shards:
        raise FileNotFoundError(f"{index} maps no weights")
    return dict(sorted(shards.items()))


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of the checkpoint (the index's shards when it has one)."""
    return list(checkpoint_shards(path))


class ShardFile:
    """One safetensors file, memory-mapped privately (copy-on-write) on first use."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.entries = read_header(file)
        self._map: mmap.mmap | None = None

    def _mapping(self) -> mmap.mmap:
        if self._map is None:
            with open(self.file, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._map

    def tensor(self, key: str) -> torch.Tensor:
        """A view of ``key``'s bytes (a copy only when the file misaligns them)."""
        entry = self.entries.get(key)
        if entry is None:
            raise KeyError(f"{self.file.name} has no tensor {key!r}")
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        mapping = self._mapping()
        itemsize = torch.empty((), dtype=entry.dtype).element_size()
        if entry.start % itemsize == 0:
            flat = torch.frombuffer(
                mapping, dtype=entry.dtype, count=entry.nbytes // itemsize, offset=entry.start
            )
            return flat.view(entry.shape)
        raw = torch.frombuffer(mapping, dtype=torch.uint8, count=entry.nbytes, offset=entry.start)
        return raw.clone().view(entry.dtype).reshape(entry.shape)

    def release(self, key: str) -> None:
        """Give back the memory of ``key``'s pages; they are read from the file again if a view
        is touched later (the mapping is never written, so nothing is lost)."""
        entry = self.entries[key]
        if self._map is None or entry.nbytes == 0:
            return
        start = entry.start // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(-(-entry.end // mmap.PAGESIZE) * mmap.PAGESIZE, len(self._map))
        self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


def iter_tensors(
    path: str | Path, select: Callable[[str], str | None], release: bool = False
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(name, key, view)`` for every checkpoint key that ``select`` maps to a name.

    Files are visited one after the other; a file's mapping goes once the caller drops the
    views it took from it. With ``release``, each tensor's pages are given back as soon as the
    caller asks for the next one, so a caller that copies each tensor before moving on holds
    one tensor of the file at a time instead of all it has read.
    """
    for file, keys in checkpoint_shards(path).items():
        shard = ShardFile(file)
        absent = [key for key in keys if key not in shard.entries]
        if absent:
            raise ValueError(f"{WEIGHTS_INDEX} maps {absent[:3]} to {file.name}, which lacks them")
        for key in keys:
            name = select(key)
            if name is not None:
                yield name, key, shard.tensor(key)
                if release:
                    shard.release(key)
        del shard


@dataclass(frozen=True)
class CopyStats:
    """What ``copy_into`` read."""

    num_tensors: int
    nbytes: int  # as stored in the files


def copy_into(
    targets: dict[str, torch.Tensor],
    path: str | Path,
    select: Callable[[str], str | None],
    ignore_unknown: bool = False,
) -> CopyStats:
    """Copy every checkpoint tensor ``select`` names into ``targets[name]``, one at a time.

    The dtype is converted by the copy and each tensor's file pages are given back right after
    it, so the caller's memory grows by the targets alone. Raises ``ValueError`` for a shape
    that differs from its target's, a target the checkpoint lacks, and (unless
    ``ignore_unknown``) a selected tensor no target takes.
    """
    loaded: set[str] = set()
    nbytes = 0
    with torch.no_grad():
        for name, key, tensor in iter_tensors(path, select, release=True):
            target = targets.get(name)
            if target is None:
                if ignore_unknown:
                    continue
                raise ValueError(f"{path}: {key} has no place in the model (as {name!r})")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"{path}: {key} has shape {tuple(tensor.shape)}, the config "
                    f"implies {tuple(target.shape)}"
                )
            target.copy_(tensor)
            nbytes += tensor.nbytes
            loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {missing[:5]} ({len(missing)} missing)")
    return CopyStats(len(loaded), nbytes)
