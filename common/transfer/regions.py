"""Memory regions backing the transfer buffers: private memory or files in /dev/shm.

Every region is backed by memory at allocation: private pages are touched, a shm file is
fallocated. The first transfers into a block then do not pay for allocating its pages, and a
machine short of memory (or a container whose /dev/shm is smaller than the buffers, 64 MiB by
default under Docker) fails at start-up with a clear error instead of later, mid-transfer,
with a SIGBUS or the OOM killer.

A shm region is a file ``/dev/shm/<name>`` mapped into this process; a same-host peer maps the
same file to write into it. ``close`` unlinks the file (the mapping itself goes away with the
last tensor view), so a clean shutdown leaves nothing behind in /dev/shm. A killed process
cannot clean up: ``sweep_stale_regions`` (run whenever shm regions are created) unlinks the
files whose owner pid, which is part of the name, no longer exists.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
import uuid
from dataclasses import dataclass, field

import torch

SHM_DIR = "/dev/shm"


@dataclass
class Region:
    """``nbytes`` of memory at ``base``; ``data`` is a flat uint8 view of it."""

    data: torch.Tensor
    base: int
    nbytes: int
    shm_name: str = ""
    _mmap: mmap.mmap | None = field(default=None, repr=False)

    def close(self) -> None:
        if self.shm_name:
            try:
                os.unlink(os.path.join(SHM_DIR, self.shm_name))
            except FileNotFoundError:
                pass
            self.shm_name = ""


SHM_PREFIX = "epd-transfer-"
_SHM_NAME = re.compile(r"epd-transfer-[0-9]{1,10}-[0-9a-f]{12}-(rows|fill_ids|positions|aux)")


def shm_name(tag: str) -> str:
    return f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}-{tag}"


def valid_shm_name(name: str, tag: str | None = None) -> bool:
    """Whether ``name`` is one ``shm_name`` makes (for the field ``tag``, when given)."""
    match = _SHM_NAME.fullmatch(name)
    return match is not None and (tag is None or match.group(1) == tag)


def sweep_stale_regions() -> list[str]:
    """Unlink region files left behind by dead processes; returns their names."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        pid_text = name[len(SHM_PREFIX) :].split("-", 1)[0]
        if not name.startswith(SHM_PREFIX) or not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass
        except PermissionError:
            pass  # alive, another user's
    return removed


def allocate_region(nbytes: int, tag: str, shared: bool) -> Region:
    """Private memory or a fresh /dev/shm file of ``nbytes`` bytes, backed (see above)."""
    if nbytes <= 0:
        raise ValueError(f"region {tag} must have a positive size")
    if not shared:
        data = torch.empty(nbytes, dtype=torch.uint8).zero_()
        return Region(data, data.data_ptr(), nbytes)
    name = shm_name(tag)
    fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        _reserve_shm(fd, nbytes, tag)
        mapped = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        os.unlink(os.path.join(SHM_DIR, name))
        raise
    os.close(fd)
    data = torch.frombuffer(mapped, dtype=torch.uint8)
    return Region(data, data.data_ptr(), nbytes, name, mapped)


def _reserve_shm(fd: int, nbytes: int, tag: str) -> None:
    """Size the shm file and allocate its pages; ENOSPC with the sizes when it cannot fit."""
    stats = os.statvfs(SHM_DIR)
    free = stats.f_bavail * stats.f_frsize
    problem = OSError(
        errno.ENOSPC,
        f"{SHM_DIR} cannot hold the {tag} transfer region ({nbytes / 2**20:.0f} MiB, "
        f"{free / 2**20:.0f} MiB free): enlarge {SHM_DIR} (docker --shm-size, a memory-backed "
        "emptyDir) or set EPD_TRANSFER_TRANSPORT=mooncake",
    )
    if nbytes > free:
        raise problem
    os.ftruncate(fd, nbytes)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise problem from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def map_peer_region(name: str, nbytes: int) -> tuple[mmap.mmap, int]:
    """Map a peer's shm region; returns the mapping and its address in this process.

    ValueError unless ``name`` is a region name (no other file under /dev/shm, no path, no
    symbolic link) of a regular file of exactly ``nbytes`` bytes.
    """
    if not valid_shm_name(name):
        raise ValueError(f"not a transfer shm region: {name[:80]!r}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != nbytes:
            raise ValueError(
                f"shm region {name} is {info.st_size} bytes, the init advertises {nbytes}"
            )
        mapped = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    view = torch.frombuffer(mapped, dtype=torch.uint8)
    return mapped, view.data_ptr()
