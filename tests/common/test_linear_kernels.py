"""The prepacked oneDNN linear computes what ``F.linear`` computes; an unusable kernel falls
back to the plain one and says why."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from common.linear_kernels import (
    PackedLinear,
    onednn_usable,
    pack_linears,
    resolve_linear_kernel,
    use_linear_kernel,
)

CPU = torch.device("cpu")
ONEDNN, WHY_NOT = onednn_usable(CPU, torch.bfloat16)
needs_onednn = pytest.mark.skipif(not ONEDNN, reason=WHY_NOT)
ONEDNN_FP32, WHY_NOT_FP32 = onednn_usable(CPU, torch.float32)
needs_onednn_fp32 = pytest.mark.skipif(not ONEDNN_FP32, reason=WHY_NOT_FP32)


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 64), (16, 64), (300, 64), (2, 7, 64)])
def test_packed_linear_equals_f_linear(shape, bias):
    torch.manual_seed(0)
    plain = nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    expected = plain(x)
    got = PackedLinear(plain.weight, plain.bias)(x)
    assert got.shape == expected.shape == (*shape[:-1], 96)
    assert torch.equal(got, expected)
    transposed = torch.randn(64, shape[0], dtype=torch.bfloat16).t()  # not contiguous
    assert torch.equal(PackedLinear(plain.weight, plain.bias)(transposed), plain(transposed))


@needs_onednn_fp32
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 256), (16, 256), (300, 256), (2, 7, 256)])
def test_packed_linear_in_fp32_is_f_linear_summed_in_another_order(shape, bias):
    """fp32: oneDNN and MKL add the 256 products of each output in their own orders, so the
    results differ by a few roundings (~1e-7 of the output's scale here), never more."""
    torch.manual_seed(0)
    plain = nn.Linear(256, 384, bias=bias)
    x = torch.randn(*shape)
    expected = plain(x)
    got = PackedLinear(plain.weight, plain.bias)(x)
    assert got.dtype == torch.float32 and got.shape == expected.shape == (*shape[:-1], 384)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    transposed = torch.randn(256, shape[0]).t()  # not contiguous
    torch.testing.assert_close(
        PackedLinear(plain.weight, plain.bias)(transposed), plain(transposed), rtol=1e-5, atol=1e-5
    )


@needs_onednn
def test_pack_linears_swaps_every_linear_and_keeps_the_rest():
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Sequential(nn.Linear(16, 4)))
    model = model.to(torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    expected = model(x)
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert isinstance(model[1], nn.SiLU)
    assert not list(model.parameters())  # the loaded weights were released
    assert torch.equal(model(x), expected)


def test_auto_and_fallbacks(caplog):
    assert resolve_linear_kernel("plain", CPU, torch.bfloat16) == "plain"
    assert resolve_linear_kernel("plain", CPU, torch.float32) == "plain"
    assert resolve_linear_kernel("auto", CPU, torch.float32) == (
        "onednn" if ONEDNN_FP32 else "plain"
    )
    assert resolve_linear_kernel("auto", CPU, torch.bfloat16) == ("onednn" if ONEDNN else "plain")
    assert resolve_linear_kernel("auto", CPU, torch.float16) == "plain"
    with caplog.at_level(logging.WARNING, logger="common.linear_kernels"):
        assert resolve_linear_kernel("onednn", CPU, torch.float16) == "plain"
    assert "packs fp32 and bf16 weights only, the model is torch.float16" in caplog.text
    assert not onednn_usable(torch.device("cuda"), torch.bfloat16)[0]
    with pytest.raises(ValueError, match="linear kernel must be one of"):
        resolve_linear_kernel("compiled", CPU, torch.float32)


def test_plain_keeps_the_model_as_loaded():
    model = nn.Sequential(nn.Linear(8, 8))
    assert use_linear_kernel(model, "plain", CPU, torch.float32, "test model") == "plain"
    assert isinstance(model[0], nn.Linear)
    half = nn.Sequential(nn.Linear(8, 8)).to(torch.float16)
    assert use_linear_kernel(half, "auto", CPU, torch.float16, "test model") == "plain"
    assert isinstance(half[0], nn.Linear)
