"""What ``--dtype auto`` means for the peer benchmark: whatever our services pick for ``auto``.

Both systems then get that dtype *explicitly* (vLLM's ``--dtype``, our workers' ``--dtype``), so
they compute in the same one. The rule is asked of the services' own code, imported
defensively because it moves: ``common.compute.resolve_compute`` (one rule for both workers),
else the older per-service functions (the language worker's ``resolve_device``, the encoder's
``pick_device``); when none can be imported, the same rule is applied here: bf16 where the CPU
has native bf16 (``amx_bf16`` / ``avx512_bf16``) and oneDNN uses it, else fp32.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

CHOICES = ("auto", "float32", "bfloat16")
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def _name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _compute_rule() -> tuple[str, str] | None:
    with contextlib.suppress(Exception):
        from common.compute import resolve_compute

        compute = resolve_compute("cpu", "auto")
        return _name(compute.dtype), f"common.compute.resolve_compute: {compute.reason}"
    return None


def _service_rules() -> tuple[str, str] | None:
    with contextlib.suppress(Exception):
        from services.language.config import LanguageConfig
        from services.language.engine.engine import resolve_device

        language = _name(resolve_device(LanguageConfig(device="cpu", dtype="auto"))[1])
        return language, "the language worker's resolve_device"
    with contextlib.suppress(Exception):
        from services.encoder.vision import pick_device

        return _name(pick_device("cpu", "auto")[1]), "the encoder's pick_device"
    return None


def _fallback_rule() -> tuple[str, str]:
    import torch

    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() == "flags":
                flags = set(line.split(":", 1)[1].split())
                break
    native = [f for f in NATIVE_BF16_FLAGS if f in flags]
    onednn = False
    with contextlib.suppress(Exception):
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if native and onednn:
        return "bfloat16", f"the benchmark's own rule: the CPU has {', '.join(native)}"
    return "float32", "the benchmark's own rule: no native bf16 on this CPU"


def resolve_dtype(dtype: str) -> tuple[str, str]:
    """(``float32`` or ``bfloat16``, why): ``dtype`` itself, or what our services pick for
    ``auto`` on the CPU."""
    if dtype not in CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(CHOICES)}, got {dtype!r}")
    if dtype != "auto":
        return dtype, "asked for"
    chosen, why = _compute_rule() or _service_rules() or _fallback_rule()
    if chosen not in CHOICES[1:]:
        raise ValueError(f"auto resolved to {chosen!r} ({why}); the benchmark takes fp32 or bf16")
    return chosen, f"what our services pick for auto; {why}"
