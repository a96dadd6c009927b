"""The allocator of the serving processes: tcmalloc, which keeps freed memory for reuse.

A CPU tensor of tens of MB (a batch of images through the ViT: 16k patches x 1280 fp32 is 84 MB;
a prefill chunk's MLP activations) is above glibc malloc's mmap threshold (32 MB at most, and a
worker thread's arena maps anything past its 64 MB heaps): each one is mapped fresh, unmapped
when freed, and the next one page-faults every page in again. On the 2-core VM this project is
measured on, an 84 MB fp32 copy ran at ~6 GB/s that way against ~19 GB/s from reused memory,
each of the ViT's elementwise passes (RMSNorm's six, SiLU, the residual adds) was 4-5x slower,
and the bench checkpoint's encoder spent ~0.8 core-seconds per 448² image. glibc's own knobs
(one arena, high mmap and trim thresholds) help only in part: torch allocates 64-byte aligned,
and glibc's aligned allocations reuse a freed block of the same size only every other time.
tcmalloc (``libtcmalloc_minimal.so.4``; vLLM's CPU platform preloads one too) keeps freed spans
and hands them back: after its first tensor, a thread's 84 MB tensors fault no page in. The
gateway has no tensors but the same pattern: a chat request with four 448² PNGs is a body of ~3 MB,
then its decoded bytes and the protobuf message that carries them, each allocated and freed once a
request: on glibc's malloc the gateway took ~22 ms of CPU a request (four images at c = 16, 2
cores; a quarter of it page faults and the kernel zeroing pages), on tcmalloc 14 ms.

A library preloaded by the dynamic linker must be there when the process starts, so ``epd serve
ROLE`` restarts itself once (``restart_with_allocator``: the same PID, arguments and open files,
before torch is imported) with ``LD_PRELOAD`` naming it, unless
``LD_PRELOAD`` is set already (an operator's own choice wins; ``LD_PRELOAD=`` keeps glibc's
malloc) or the library is not installed (``make setup`` and the Docker image install it; the log
says which allocator runs). ``release_free_memory`` returns what is free now: the services call
it once their weights are loaded, so what loading and prepacking freed does not stay resident.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

TCMALLOC = "libtcmalloc_minimal.so.4"
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")


def find_tcmalloc(dirs: tuple[str, ...] = LIBRARY_DIRS) -> str | None:
    """The path of tcmalloc's shared library, or None when it is not installed."""
    for directory in dirs:
        path = Path(directory) / TCMALLOC
        if path.is_file():
            return str(path)
    return None


def with_allocator(environ: Mapping[str, str], library: str | None) -> dict[str, str] | None:
    """``environ`` with ``library`` preloaded, or None: no library, or ``LD_PRELOAD`` is set."""
    if library is None or "LD_PRELOAD" in environ:
        return None
    return {**environ, "LD_PRELOAD": library}


def restart_with_allocator() -> None:
    """Replace this process with itself (same PID, arguments and open files) with tcmalloc
    preloaded; returns only when there is nothing to do (see ``with_allocator``)."""
    env = with_allocator(os.environ, find_tcmalloc())
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def _tcmalloc_release() -> Callable[[], None] | None:
    """tcmalloc's ``MallocExtension_ReleaseFreeMemory`` when tcmalloc is this process's
    allocator."""
    return getattr(ctypes.CDLL(None), "MallocExtension_ReleaseFreeMemory", None)


def allocator_line() -> str:
    """One line for a service's start-up log: which allocator runs."""
    if _tcmalloc_release() is not None:
        return "allocator: tcmalloc (freed memory kept for reuse)"
    hint = "" if find_tcmalloc() else f": {TCMALLOC} is not installed (make setup installs it)"
    return f"allocator: the C library's malloc{hint}"


def release_free_memory() -> None:
    """Return the allocator's free pages to the kernel (tcmalloc or glibc; else nothing)."""
    release = _tcmalloc_release()
    if release is not None:
        release()
        return
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
