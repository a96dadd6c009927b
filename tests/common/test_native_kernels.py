"""The native element-wise kernels: built with the system's C compiler, against torch's ops.

RMSNorm equals torch's formula up to a row's sum order (float32: within 1e-6 relative; bf16: at
most one bf16 step, in a small share of the values); the vision rotary embedding equals
``rotate_qk`` bit for bit. Where the kernels cannot be built the services keep torch's ops and
say why; asking for them explicitly then fails naming the reason.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import native_kernels
from common.native_kernels import (
    NativeKernels,
    build,
    load_native_kernels,
    resolve_elementwise_kernel,
    use_native_rms_norms,
)
from services.encoder.vision_attention import rotate_qk
from services.language.model.layers import RMSNorm

CPU = torch.device("cpu")
KERNELS, WHY_NOT = load_native_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason=f"native kernels: {WHY_NOT}")


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values apart each of ``a`` and ``b`` are (same signs assumed)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (16, 256), (3, 7, 128), (600, 80)])
def test_rms_norm_matches_torch(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    got, want = KERNELS.rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        steps = bf16_steps(got, want)
        assert int(steps.max()) <= 1
        assert float((steps > 0).float().mean()) < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reads_strided_rows(dtype):
    """Rows of a view (one half of each wider row, as a split gives) and a transposed input."""
    x = torch.randn(40, 512).to(dtype)
    weight = torch.randn(256).to(dtype)
    half = x[:, 256:]
    assert not half.is_contiguous()
    torch.testing.assert_close(
        KERNELS.rms_norm(half, weight, 1e-5), torch_rms_norm(half, weight, 1e-5), rtol=0, atol=0.02
    )
    t = torch.randn(256, 40).to(dtype).t()
    torch.testing.assert_close(
        KERNELS.rms_norm(t, weight, 1e-5), torch_rms_norm(t, weight, 1e-5), rtol=0, atol=0.02
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq,heads,dim", [(5, 2, 8), (1100, 4, 32), (300, 16, 80)])
def test_rotate_qk_is_bit_equal(dtype, seq, heads, dim):
    gen = torch.Generator().manual_seed(seq)
    qkv = torch.randn(seq, 3, heads, dim, generator=gen).to(dtype)
    angles = torch.randn(seq, dim // 2, generator=gen) * 10
    emb = torch.cat((angles, angles), dim=-1)
    got = KERNELS.rotate_qk(qkv, emb.cos(), emb.sin())
    want = rotate_qk(qkv, emb.cos(), emb.sin())
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and torch.equal(g, w)


def test_language_rms_norm_uses_the_kernel_where_it_applies():
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(9, 64).to(torch.bfloat16)
    plain = norm(x)
    norm.native = KERNELS
    assert int(bf16_steps(norm(x), plain).max()) <= 1
    norm.half()  # a dtype the kernels lack: torch's ops, exactly
    half = torch.randn(9, 64, dtype=torch.float16)
    assert torch.equal(norm(half), torch_rms_norm(half, norm.weight, norm.eps))


def test_transformers_rms_norms_are_swapped_per_instance():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

    block = torch.nn.Sequential(
        Qwen2_5_VLRMSNorm(32), torch.nn.Linear(32, 32), Qwen2_5_VLRMSNorm(32)
    ).to(torch.bfloat16)
    other = Qwen2_5_VLRMSNorm(32)
    x = torch.randn(4, 32).to(torch.bfloat16)
    want = block(x)
    assert use_native_rms_norms(block, KERNELS) == 2
    assert int(bf16_steps(block(x), want).max()) <= 1
    assert "forward" not in vars(other)  # the class and other instances are untouched
    # an input the kernels do not take (float32 beside a bf16 weight): the class's own forward
    assert torch.equal(block[0](x.float()), Qwen2_5_VLRMSNorm.forward(block[0], x.float()))


def test_auto_takes_native_on_a_cpu_in_bf16_only(caplog):
    with caplog.at_level(logging.INFO, logger="common.native_kernels"):
        assert resolve_elementwise_kernel("auto", CPU, torch.bfloat16, "m") is KERNELS
        assert resolve_elementwise_kernel("auto", CPU, torch.float32, "m") is None
        assert resolve_elementwise_kernel("auto", torch.device("cuda"), torch.bfloat16, "m") is None
        assert resolve_elementwise_kernel("torch", CPU, torch.bfloat16, "m") is None
    assert "auto keeps torch's ops in torch.float32" in caplog.text
    assert resolve_elementwise_kernel("native", CPU, torch.float32, "m") is KERNELS
    with pytest.raises(RuntimeError, match="on cuda"):
        resolve_elementwise_kernel("native", torch.device("cuda"), torch.bfloat16, "m")
    with pytest.raises(RuntimeError, match="no native kernels for torch.float16"):
        resolve_elementwise_kernel("native", CPU, torch.float16, "m")
    with pytest.raises(ValueError, match="elementwise_kernel 'fused'"):
        resolve_elementwise_kernel("fused", CPU, torch.bfloat16, "m")


def test_without_a_compiler_auto_falls_back_and_native_says_why(monkeypatch, tmp_path, caplog):
    with pytest.raises(RuntimeError, match="no C compiler"):
        build(cc="no-such-cc", out_dir=tmp_path)
    monkeypatch.setattr(native_kernels, "load_native_kernels", lambda: (None, "no C compiler"))
    with caplog.at_level(logging.WARNING, logger="common.native_kernels"):
        assert resolve_elementwise_kernel("auto", CPU, torch.bfloat16, "vision tower") is None
    assert "vision tower: element-wise ops: torch (native kernels unavailable: no C compiler)" in (
        caplog.text
    )
    with pytest.raises(RuntimeError, match="elementwise_kernel native: no C compiler"):
        resolve_elementwise_kernel("native", CPU, torch.bfloat16, "vision tower")


def test_a_failed_build_names_the_compiler_error(tmp_path, monkeypatch):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(native_kernels, "SOURCE", broken)
    with pytest.raises(RuntimeError, match="building the native kernels failed"):
        build(out_dir=tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.so"))  # nothing half-written left to load


def test_the_build_is_cached_and_concurrent_builds_agree(tmp_path):
    """Four processes build into one empty cache at once: each loads a whole library, one
    file results, and a later build reuses it without compiling."""
    script = (
        "import sys; from pathlib import Path; from common.native_kernels import build, "
        "NativeKernels; p = build(out_dir=Path(sys.argv[1])); NativeKernels(p); print(p)"
    )
    root = Path(__file__).resolve().parents[2]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            cwd=root,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(root)},
        )
        for _ in range(4)
    ]
    paths = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    built = list(tmp_path.glob("*.so"))
    assert len(paths) == 1 and [str(b) for b in built] == list(paths)
    mtime = built[0].stat().st_mtime_ns
    assert build(out_dir=tmp_path) == built[0] and built[0].stat().st_mtime_ns == mtime
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".build-")]


def test_supports_only_cpu_tensors_of_one_known_dtype():
    a = torch.zeros(2, 4, dtype=torch.bfloat16)
    assert NativeKernels.supports(a, a)
    assert not NativeKernels.supports(a, a.float())
    assert not NativeKernels.supports(a.half(), a.half())
