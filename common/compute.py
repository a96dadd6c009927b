"""Where a service computes and in what dtype: one rule for the encoder and the language worker.

``auto`` picks what the hardware runs fast, decided at start-up from what the processor says it
can do, never from the device type alone:

* CUDA: bfloat16.
* CPU with native bf16 instructions (``amx_bf16`` or ``avx512_bf16`` in ``/proc/cpuinfo``) and a
  oneDNN build that uses them: bfloat16. Such a processor runs a bf16 ``linear`` several times
  faster than fp32 and reads half the bytes per weight.
* Any other CPU: float32 (bf16 there is emulated and runs slower than fp32).

The choice and its reason are returned together so the service logs why it chose what it did.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from common.linear_kernels import LINEAR_KERNELS
from common.native_kernels import CPU_KERNELS

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")  # what a config's ``device`` may say
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # either one: bf16 dot products in hardware


@dataclass(frozen=True)
class Compute:
    """A service's device and compute dtype, with the reason ``auto`` chose the dtype."""

    device: torch.device
    dtype: torch.dtype
    reason: str  # one line for the start-up log


def check_compute_settings(
    device: str,
    dtype: str,
    linear_kernel: str,
    cpu_kernels: str = "auto",
    linear_kernels: tuple[str, ...] = LINEAR_KERNELS,
) -> None:
    """A config's ``device``, ``dtype``, ``linear_kernel`` (one of ``linear_kernels``) and
    ``cpu_kernels``: a ``ValueError`` naming the bad one."""
    if not DEVICE_PATTERN.fullmatch(device):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if linear_kernel not in linear_kernels:
        raise ValueError(f"linear_kernel must be one of {linear_kernels}, got {linear_kernel!r}")
    if cpu_kernels not in CPU_KERNELS:
        raise ValueError(f"cpu_kernels must be one of {CPU_KERNELS}, got {cpu_kernels!r}")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's feature flags (empty when the file is not there or has none)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_native_bf16(flags: frozenset[str] | None = None) -> tuple[bool, str]:
    """(True, why) when this CPU computes bf16 natively and torch's oneDNN can use it."""
    flags = cpu_flags() if flags is None else flags
    native = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if not native:
        return False, f"the CPU has none of {', '.join(NATIVE_BF16_FLAGS)}"
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False, f"the CPU has {', '.join(native)} but torch's oneDNN does not use bf16"
    return True, f"the CPU has {', '.join(native)}"


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` (CUDA when present, else CPU) | cpu | cuda | cuda:N; a CUDA device that is not
    there is a ``ValueError``."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = torch.device(device)
    if chosen.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = chosen.index or 0
        if index >= count:
            raise ValueError(f"device {device} requested but {count} CUDA devices are visible")
        chosen = torch.device("cuda", index)
    return chosen


def resolve_compute(
    device: str = "auto", dtype: str = "auto", flags: frozenset[str] | None = None
) -> Compute:
    """The device and dtype a service runs in; ``flags`` stands in for the CPU's (tests)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    chosen = resolve_device(device)
    if dtype != "auto":
        return Compute(chosen, getattr(torch, dtype), f"{dtype} as configured")
    if chosen.type == "cuda":
        return Compute(chosen, torch.bfloat16, "auto: bfloat16 on CUDA")
    native, why = cpu_native_bf16(flags)
    if native:
        return Compute(chosen, torch.bfloat16, f"auto: bfloat16, {why}")
    return Compute(chosen, torch.float32, f"auto: float32, {why}")


def prepare_device(device: torch.device) -> None:
    """Process-wide settings for ``device``, made once before a service's first forward.

    CUDA:

    * torch's cuDNN attention kernel is turned off. It builds an execution plan for every new
      shape, and a server sees new shapes all the time (each decode step's key length, each
      image's patch count): on an H100 that took ~11 ms of host time per call against ~12 us on
      the GPU, 45-49 ms per decode step of a 4-layer model (4-8 ms without it). The flash and
      memory-efficient kernels take any shape as it comes.
    * fp32 convolutions run in fp32: cuDNN rounds their inputs to TF32 (10-bit mantissa) unless
      told not to, which put an fp32 vision tower's rows 7.8e-4 off the CPU's (the patch
      embedding is the tower's one convolution). bf16 convolutions are unaffected.
    """
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cudnn.allow_tf32 = False


def set_compute_threads(num_threads: int) -> int:
    """Use ``num_threads`` intra-op threads in this process (0: leave torch's default); returns
    the number in use."""
    if num_threads < 0:
        raise ValueError(f"compute_threads must be >= 0, got {num_threads}")
    if num_threads:
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()


@contextlib.contextmanager
def intra_op_threads(num_threads: int) -> Iterator[None]:
    """Run the block's torch operators on ``num_threads`` intra-op threads (this thread's
    setting only: OpenMP keeps one per calling thread), then restore the previous number."""
    before = torch.get_num_threads()
    if num_threads == before:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
