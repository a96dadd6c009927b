"""The kernel behind a model's ``nn.Linear`` layers, chosen once when the model is loaded.

* ``plain``: ``torch.nn.functional.linear`` on the weights as loaded. The reference path: every
  other kernel is tested against it.
* ``onednn``: oneDNN's matmul with each weight reordered ("prepacked") once into the blocked
  layout the CPU's vector and matrix units read (AVX-512, AVX-512 BF16, AMX tiles), in bf16 or
  fp32. In bf16 a plain ``linear`` reorders the weight again on every call; prepacked it runs
  ~1.2-2x faster, with the same results where the CPU has native bf16 (tested bit for bit
  against ``plain``; where bf16 is emulated the two accumulate in other orders). In fp32 the
  plain path is MKL's GEMM, slow at decode-sized batches: prepacked, 4-32 rows run 2-3.3x
  faster (Cascade Lake, 2 cores: the demo LM head at 16 rows 36 -> 11 ms, Qwen2.5-VL-3B's
  down projection 12.7 -> 6.4 ms), one row 0.85-1.2x, prefill-sized batches the same. oneDNN
  sums in another order than MKL there: within ~1e-6 relative of ``plain``, not bit-equal
  (the fp32 equality tests run both kernels against transformers).
  Assumes: CPU, fp32 or bf16 weights and inputs, a torch built with oneDNN (that supports
  bf16, for bf16).
* ``auto``: ``onednn`` where its assumptions hold, else ``plain``.

A module keeps its structure; only its ``nn.Linear`` children are swapped for ``PackedLinear``.
The engine and the encoder never ask which kernel runs.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

LINEAR_KERNELS = ("auto", "plain", "onednn")
PACKED_DTYPES = (torch.float32, torch.bfloat16)
PACK_BATCH_HINT = 16  # the batch size oneDNN tunes the packed layout for; any size still works


def onednn_usable(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """(True, "") when prepacked oneDNN linears can run here, else (False, why not)."""
    if device.type != "cpu":
        return False, f"it runs on the CPU only, the model is on {device}"
    if dtype not in PACKED_DTYPES:
        return False, f"it packs fp32 and bf16 weights only, the model is {dtype}"
    if not torch.backends.mkldnn.is_available():
        return False, "this torch has no oneDNN"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False, "oneDNN does not support bf16 on this CPU"
    return True, ""


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` prepacked by oneDNN. Inputs of any rank ``[..., in]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().contiguous(), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(
            flat, self.packed_weight, self.bias, "none", [], ""
        )
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def resolve_linear_kernel(kernel: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel that will run: ``auto`` resolved, an unusable ``onednn`` falls back to
    ``plain`` with a warning saying why."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"linear kernel must be one of {LINEAR_KERNELS}, got {kernel!r}")
    if kernel == "plain":
        return "plain"
    usable, why = onednn_usable(device, dtype)
    if usable:
        return "onednn"
    if kernel == "onednn":
        logger.warning("linear kernel onednn is not usable (%s): falling back to plain", why)
    return "plain"


def pack_linears(module: nn.Module) -> int:
    """Swap every ``nn.Linear`` under ``module`` for a ``PackedLinear``; returns how many.

    The loaded weights are released: afterwards the packed copies are the only ones, except
    where a weight is also used elsewhere (a tied embedding keeps its table).
    """
    num = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                num += 1
    return num


def use_linear_kernel(
    module: nn.Module, kernel: str, device: torch.device, dtype: torch.dtype, what: str
) -> str:
    """Give ``module``'s linears the chosen kernel; logs and returns the one that runs."""
    chosen = resolve_linear_kernel(kernel, device, dtype)
    if chosen == "onednn":
        num = pack_linears(module)
        logger.info("%s: %d linear layers prepacked for oneDNN (%s)", what, num, dtype)
    else:
        logger.info("%s: plain linear layers", what)
    return chosen
