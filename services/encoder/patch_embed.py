"""The ViT's patch embedding as the matrix product it is.

Qwen-VL towers embed each patch (``channels x temporal x patch x patch`` pixels) with a
``Conv3d`` whose kernel equals its stride and whose input is exactly one kernel wide: every
output is one dot product of a whole patch with each filter, i.e. ``patches @ W.T``. The CPU's
convolution path does not see that and runs 3.5x (fp32) to 30x (bf16) slower than the same
product as a linear layer (measured on 1,024 patches, bench widths: 223 ms vs 7 ms in bf16).

Used with the fast kernel only (``linear_kernel`` onednn, fp32 or bf16): the product sums in
another order than the convolution, so it is close to the reference (within the dtype's
rounding) but not bit-equal; the plain kernel keeps transformers' convolution, the path the
bit-for-bit golden tests check.
"""

from __future__ import annotations

import torch
from torch import nn

from common.linear_kernels import PackedLinear


class PatchLinear(nn.Module):
    """Stands in for ``patch_embed.proj``: same ``weight`` (its dtype is what the tower casts
    the pixels to), output ``[num_patches, embed_dim]``."""

    def __init__(self, conv: nn.Conv3d) -> None:
        super().__init__()
        self.weight = conv.weight
        self.bias = conv.bias
        self.linear = PackedLinear(conv.weight.detach().flatten(1), conv.bias)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.linear(patches.reshape(patches.shape[0], -1))


def is_patch_conv(conv: nn.Module) -> bool:
    """A ``Conv3d`` that cuts its input into non-overlapping patches, one per output."""
    return (
        isinstance(conv, nn.Conv3d)
        and tuple(conv.kernel_size) == tuple(conv.stride)
        and tuple(conv.padding) == (0, 0, 0)
        and tuple(conv.dilation) == (1, 1, 1)
        and conv.groups == 1
    )


def patch_embed_as_linear(tower: nn.Module) -> bool:
    """Swap ``tower.patch_embed.proj`` for a ``PatchLinear``; False (nothing changed) when the
    tower has no such convolution."""
    embed = getattr(tower, "patch_embed", None)
    conv = getattr(embed, "proj", None)
    if conv is None or not is_patch_conv(conv):
        return False
    embed.proj = PatchLinear(conv)
    return True
