"""The LM head on the native bf16 kernel (``common/native_lm_head.c``): logits, or each row's
greedy choice without the logits.

A decode step's head is a few rows against the whole vocabulary: on a CPU it reads the weight
once and is bound by that read, and a step whose rows are all greedy needs only each row's
maximum. ``maxima`` finds it while the logits are made, so the ``[rows, vocab]`` logits are
neither written nor read back by a reduction. Measured on 2 cores (Zen 4, bf16, 16 rows; oneDNN's
prepacked linear then ``row_max``): the demo head (256 x 151,669) 4.9 -> 2.9 ms, Qwen2.5-VL-3B's
(2,048 x 151,936) 29 -> 24 ms. A logit is its float32 sum rounded to bf16, as a bf16 matrix
product's is; the sums run in another order than oneDNN's, so a logit may differ from its one
bf16 step (tested against float32 as oneDNN's are).
"""

from __future__ import annotations

import torch
from torch import nn

from common.native_kernels import NativeKernels


class NativeLMHead(nn.Module):
    """``y = x @ W.T`` for ``W`` [vocab, hidden] (bf16), packed once for the native kernel."""

    def __init__(self, weight: torch.Tensor, native: NativeKernels) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.native = native
        packed = native.pack_lm_head(weight.detach())
        self.register_buffer("packed_weight", packed, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] (bf16) of ``h`` [n, hidden]."""
        return self.native.lm_head_logits(h, self.packed_weight, self.out_features)

    def maxima(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's largest logit (float32 [n]; NaN where a logit is NaN or +inf) and the first
        token holding it (long [n])."""
        return self.native.lm_head_maxima(h, self.packed_weight, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, native"
