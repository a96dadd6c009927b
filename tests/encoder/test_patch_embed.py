"""The patch embedding's convolution and the linear layer that replaces it agree."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common.linear_kernels import onednn_usable
from services.encoder.patch_embed import PatchLinear, is_patch_conv, patch_embed_as_linear

ONEDNN, WHY_NOT = onednn_usable(torch.device("cpu"), torch.bfloat16)


@pytest.mark.skipif(not ONEDNN, reason=WHY_NOT)
@pytest.mark.parametrize("bias", [False, True])  # Qwen2/2.5-VL: none; Qwen3-VL: a bias
def test_patch_linear_is_the_convolution(bias):
    torch.manual_seed(0)
    conv = nn.Conv3d(3, 64, (2, 14, 14), stride=(2, 14, 14), bias=bias).to(torch.bfloat16)
    patches = torch.randn(300, 3, 2, 14, 14, dtype=torch.bfloat16)
    expected = conv(patches).view(-1, 64).float()
    tower = nn.Module()
    tower.patch_embed = nn.Module()
    tower.patch_embed.proj = conv
    assert patch_embed_as_linear(tower)
    proj = tower.patch_embed.proj
    assert isinstance(proj, PatchLinear) and proj.weight.dtype == torch.bfloat16
    got = proj(patches).view(-1, 64).float()
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 2**-7 * scale  # bf16 rounding, not more


def test_only_a_patch_cutting_convolution_is_replaced():
    assert is_patch_conv(nn.Conv3d(3, 8, (2, 14, 14), stride=(2, 14, 14)))
    assert not is_patch_conv(nn.Conv3d(3, 8, (2, 14, 14), stride=(1, 14, 14)))
    assert not is_patch_conv(nn.Conv3d(3, 8, 3, stride=3, padding=1))
    assert not is_patch_conv(nn.Conv2d(3, 8, 14, stride=14))
    tower = nn.Module()
    assert not patch_embed_as_linear(tower)  # no patch embedding at all
