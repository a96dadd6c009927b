"""What ``--dtype auto`` means for the peer benchmark: whatever our services pick for ``auto``
(``common.compute.resolve_compute`` on the CPU).

Both systems then get that dtype *explicitly* (vLLM's ``--dtype``, our workers' ``--dtype``), so
they compute in the same one.
"""

from __future__ import annotations

from common.compute import resolve_compute

CHOICES = ("auto", "float32", "bfloat16")


def resolve_dtype(dtype: str) -> tuple[str, str]:
    """(``float32`` or ``bfloat16``, why): ``dtype`` itself, or what our services pick for
    ``auto`` on the CPU."""
    if dtype not in CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(CHOICES)}, got {dtype!r}")
    if dtype != "auto":
        return dtype, "asked for"
    compute = resolve_compute("cpu", "auto")
    chosen = str(compute.dtype).removeprefix("torch.")
    if chosen not in CHOICES[1:]:
        raise ValueError(f"auto resolved to {chosen!r}; the benchmark takes fp32 or bf16")
    return chosen, f"what our services pick for auto ({compute.reason})"
