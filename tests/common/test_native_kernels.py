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
    resolve_cpu_kernels,
    use_native_rms_norms,
)
from services.encoder.vision_attention import rotate_qk
from services.language.model.layers import RMSNorm
from services.language.model.rope import MRotaryEmbedding, apply_rotary

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,dim", [(1, 2, 1, 8), (16, 4, 2, 64), (600, 16, 2, 128)]
)
@pytest.mark.parametrize("normed_k", [False, True])
def test_rope_store_is_bit_equal_to_the_rotary_and_index_copies(
    dtype, tokens, heads, kv_heads, dim, normed_k
):
    """q, k and v as the attention layer has them: views of one fused projection (k a tensor of
    its own after a Qwen3 k-norm); the rotated k and v land in scattered cache slots."""
    gen = torch.Generator().manual_seed(tokens + dim)
    fused = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 4).to(dtype)
    q, k, v = fused.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = q.view(tokens, heads, dim)
    k, v = k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    if normed_k:
        k = k * 1.5
    rope = MRotaryEmbedding(dim, 1e6, (dim // 2, 0, 0), False, CPU)
    cos, sin = rope.cos_sin(torch.randint(0, 40_000, (3, tokens), generator=gen), dtype)
    slots = torch.randperm(2 * tokens + 5, generator=gen)[:tokens]
    caches = [torch.full((2 * tokens + 5, kv_heads, dim), 7.0, dtype=dtype) for _ in range(4)]
    k_want, v_want, k_got, v_got = caches
    q_want = apply_rotary(q, cos, sin)
    k_want.index_copy_(0, slots, apply_rotary(k, cos, sin))
    v_want.index_copy_(0, slots, v)
    q_got = KERNELS.rope_store(q, k, v, cos, sin, k_got, v_got, slots)
    assert q_got.dtype == dtype and torch.equal(q_got, q_want)
    assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)


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


def test_auto_takes_native_on_a_cpu_in_the_dtypes_they_have(caplog):
    with caplog.at_level(logging.INFO, logger="common.native_kernels"):
        assert resolve_cpu_kernels("auto", CPU, torch.bfloat16, "m") is KERNELS
        assert resolve_cpu_kernels("auto", CPU, torch.float32, "m") is KERNELS
        assert resolve_cpu_kernels("auto", CPU, torch.float16, "m") is None
        assert resolve_cpu_kernels("auto", torch.device("cuda"), torch.bfloat16, "m") is None
        assert resolve_cpu_kernels("torch", CPU, torch.bfloat16, "m") is None
    assert "m: CPU kernels: torch (no native kernels for torch.float16)" in caplog.text
    assert "m: CPU kernels: torch (as configured)" in caplog.text
    assert resolve_cpu_kernels("native", CPU, torch.float32, "m") is KERNELS
    with pytest.raises(RuntimeError, match="on cuda"):
        resolve_cpu_kernels("native", torch.device("cuda"), torch.bfloat16, "m")
    with pytest.raises(RuntimeError, match="no native kernels for torch.float16"):
        resolve_cpu_kernels("native", CPU, torch.float16, "m")
    with pytest.raises(ValueError, match="cpu_kernels 'fused'"):
        resolve_cpu_kernels("fused", CPU, torch.bfloat16, "m")


def test_without_a_compiler_auto_falls_back_and_native_says_why(monkeypatch, tmp_path, caplog):
    with pytest.raises(RuntimeError, match="no C compiler"):
        build(cc="no-such-cc", out_dir=tmp_path)
    monkeypatch.setattr(native_kernels, "load_native_kernels", lambda: (None, "no C compiler"))
    with caplog.at_level(logging.WARNING, logger="common.native_kernels"):
        assert resolve_cpu_kernels("auto", CPU, torch.bfloat16, "vision tower") is None
    assert "vision tower: CPU kernels: torch (native kernels unavailable: no C compiler)" in (
        caplog.text
    )
    with pytest.raises(RuntimeError, match="cpu_kernels native: no C compiler"):
        resolve_cpu_kernels("native", CPU, torch.bfloat16, "vision tower")


def test_a_failed_build_names_the_compiler_error(tmp_path, monkeypatch):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(native_kernels, "SOURCES", (*native_kernels.SOURCES[:1], broken))
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


def reference_decode_attention(q, k_cache, v_cache, slots_per_row, scale):
    """Each row's query over its keys, gathered, in float32 (the formula, not a kernel)."""
    out = []
    group = q.shape[1] // k_cache.shape[1]
    for row, slots in zip(q.float(), slots_per_row, strict=True):
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [len, heads, dim]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", row, k) * scale, dim=-1)
        out.append(torch.einsum("hl,lhd->hd", weights, v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,group,dim", [(2, 1, 64), (2, 2, 64), (1, 4, 128), (2, 8, 80)])
def test_decode_attention_reads_each_rows_slots(dtype, kv_heads, group, dim):
    """Rows of 1 to 1,100 keys at scattered slots, one of them sharing another's prefix;
    against the gathered formula: float32 within 1e-5, bf16 within a few bf16 steps of the
    outputs' scale (the weights rounded to bf16 before they meet V, as SDPA's kernel does)."""
    gen = torch.Generator().manual_seed(group * dim)
    pool = 3000
    k_cache = torch.randn(pool, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(pool, kv_heads, dim, generator=gen).to(dtype)
    lengths = [1, 7, 300, 1100, 513]
    rows = [torch.randperm(pool, generator=gen)[:n] for n in lengths]
    rows[4] = torch.cat([rows[2], torch.randperm(pool, generator=gen)[:213]])  # shared prefix
    q = torch.randn(len(rows), kv_heads * group, dim, generator=gen).to(dtype)
    offsets = torch.tensor([0, *(len(r) for r in rows)]).cumsum(0)
    got = KERNELS.decode_attention(
        q, k_cache, v_cache, torch.cat(rows), offsets, max(lengths), dim**-0.5
    )
    want = reference_decode_attention(q, k_cache, v_cache, rows, dim**-0.5)
    assert got.shape == q.shape and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=0, atol=tolerance)


def test_decode_attention_reads_query_rows_of_a_wider_tensor():
    """The queries as the model holds them: a view of the first rows of its flat batch."""
    k_cache = torch.randn(50, 2, 64)
    v_cache = torch.randn(50, 2, 64)
    q_all = torch.randn(9, 4, 64)
    slots = torch.arange(20)
    offsets = torch.tensor([0, 5, 20])
    got = KERNELS.decode_attention(q_all[:2], k_cache, v_cache, slots, offsets, 15, 0.125)
    want = reference_decode_attention(q_all[:2], k_cache, v_cache, [slots[:5], slots[5:]], 0.125)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_decode_attention_fits_small_gqa_groups_only():
    def fits(*shape, dtype=torch.float32):
        return KERNELS.decode_attention_fits(dtype, *shape)

    assert fits(4, 2, 64) and fits(16, 4, 128) and fits(2, 2, 256)
    # a group of 8: in float32 SDPA after a gather is as fast; the bf16 scores on AVX-512 BF16
    # are faster (module doc)
    assert not fits(16, 2, 128)
    assert fits(16, 2, 128, dtype=torch.bfloat16) == KERNELS.has_avx512_bf16
    assert not fits(32, 2, 128, dtype=torch.bfloat16)
    assert not fits(4, 2, 512) and not fits(6, 4, 64) and not fits(4, 0, 64)
    with pytest.raises(ValueError, match="does not fit the kernel"):
        KERNELS.decode_attention(
            torch.zeros(1, 40, 64), torch.zeros(4, 2, 64), torch.zeros(4, 2, 64),
            torch.zeros(1, dtype=torch.long), torch.tensor([0, 1]), 1, 1.0,
        )  # fmt: skip


PREFILL = KERNELS is not None and KERNELS.has_avx512_bf16
requires_prefill = pytest.mark.skipif(not PREFILL, reason="no AVX-512 BF16 prefill attention here")


def reference_prefill_attention(q, k, v, scale):
    """Causal attention of ``q`` [q_len, heads, dim] over ``k`` / ``v`` [kv_len, kv_heads, dim]
    (the prefix first) in float32: query i sees keys 0 .. kv_len - q_len + i."""
    q_len, kv_len = q.shape[0], k.shape[0]
    visible = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    heads_first = (t.float().transpose(0, 1)[None] for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        *heads_first, attn_mask=visible, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def sdpa_bf16(q, k, v, scale):
    """torch's SDPA on the bf16 tensors: what the engine runs without the kernel."""
    q_len, kv_len = q.shape[0], k.shape[0]
    visible = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=visible, scale=scale,
        enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)


@requires_prefill
@pytest.mark.parametrize(
    "q_len,kv_len,heads,kv_heads,dim",
    [
        (1, 1, 4, 2, 64),  # one token
        (5, 5, 4, 2, 32),  # shorter than a key block
        (37, 100, 4, 2, 64),  # after a 63-key prefix, tails in both
        (70, 70, 16, 2, 128),  # a group of 8 (Qwen2.5-VL-3B)
        (33, 33, 28, 4, 128),  # a group of 7 (Qwen2.5-VL-7B): rows not a multiple of 4
        (200, 1300, 4, 4, 64),  # no GQA, a long prefix
        (64, 64, 2, 2, 256),  # the widest head
        (40, 90, 16, 16, 80),  # a head of 80: 16 lanes past the last 64
    ],
)
def test_prefill_attention_is_as_accurate_as_sdpa(q_len, kv_len, heads, kv_heads, dim):
    """Against float32 attention on the same bf16 inputs, the kernel's error is SDPA's in bf16:
    the largest within one bf16 step of SDPA's largest, the mean within 5% of SDPA's."""
    gen = torch.Generator().manual_seed(q_len * kv_len + dim)
    q = (3 * torch.randn(q_len, heads, dim, generator=gen)).bfloat16()
    k = (3 * torch.randn(kv_len, kv_heads, dim, generator=gen)).bfloat16()
    v = torch.randn(kv_len, kv_heads, dim, generator=gen).bfloat16()
    scale = dim**-0.5
    out = torch.empty_like(q)
    assert KERNELS.prefill_attention(q, k, v, out, scale) is out
    want = reference_prefill_attention(q, k, v, scale)
    ours = (out.float() - want).abs()
    theirs = (sdpa_bf16(q, k, v, scale).float() - want).abs()
    assert ours.max() <= theirs.max() + 2**-8 * want.abs().max()
    assert ours.mean() <= 1.05 * theirs.mean()


@requires_prefill
def test_prefill_attention_reads_and_writes_rows_of_wider_tensors():
    """As the engine calls it: queries and outputs are rows of the step's flat batch, keys a
    slice of the KV pool; other rows are left alone."""
    gen = torch.Generator().manual_seed(7)
    q_all = torch.randn(50, 4, 64, generator=gen).bfloat16()
    pool_k = torch.randn(300, 2, 64, generator=gen).bfloat16()
    pool_v = torch.randn(300, 2, 64, generator=gen).bfloat16()
    out_all = torch.zeros(50, 4, 64, dtype=torch.bfloat16)
    q, k, v = q_all[10:30], pool_k[100:140], pool_v[100:140]
    KERNELS.prefill_attention(q, k, v, out_all[10:30], 0.125)
    want = reference_prefill_attention(q, k, v, 0.125)
    torch.testing.assert_close(out_all[10:30].float(), want, rtol=0, atol=2e-2)
    assert not out_all[:10].any() and not out_all[30:].any()


def test_attention_fits_bf16_within_the_kernels_limits():
    fits = KERNELS.attention_fits
    bf16 = torch.bfloat16
    if not PREFILL:  # this build has no AVX-512 BF16: never
        assert not fits(bf16, 4, 2, 64)
        return
    assert fits(bf16, 4, 2, 64) and fits(bf16, 16, 2, 128) and fits(bf16, 28, 4, 128)
    assert fits(bf16, 4, 4, 32) and fits(bf16, 2, 2, 256)
    assert not fits(torch.float32, 4, 2, 64)  # bf16 only
    assert fits(bf16, 16, 16, 80)  # Qwen2(.5)-VL's vision heads
    assert not fits(bf16, 16, 16, 72) and not fits(bf16, 4, 2, 512)  # head_dim (Qwen3-VL's ViT)
    assert not fits(bf16, 6, 4, 64) and not fits(bf16, 4, 0, 64) and not fits(bf16, 64, 1, 64)
    with pytest.raises(ValueError, match="do not fit the kernel"):
        q = torch.zeros(2, 4, 72, dtype=bf16)
        KERNELS.prefill_attention(q, q[:, :2], q[:, :2], torch.empty_like(q), 1.0)


def sdpa_per_piece(q, k, v, cu_seqlens, scale, causal, upcast):
    """SDPA within each piece ``cu_seqlens`` cuts, in float32 (``upcast``: the reference) or in
    the tensors' bf16 (what a per-piece SDPA gives); float32 rows out."""
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        piece = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]
        piece = [t.float() for t in piece] if upcast else piece
        out = torch.nn.functional.scaled_dot_product_attention(
            *piece, scale=scale, is_causal=causal, enable_gqa=True
        )
        outs.append(out[0].transpose(0, 1).float())
    return torch.cat(outs)


@requires_prefill
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 32), (16, 16, 80), (4, 2, 64)])
def test_self_attention_stays_within_each_piece(causal, heads, kv_heads, dim):
    """Pieces as a vision tower cuts them (windows of 64 patches, a whole image, a piece shorter
    than a key block, an empty one) in one call: each attends within itself only, as accurately
    as SDPA in bf16 per piece."""
    gen = torch.Generator().manual_seed(dim + causal)
    cu = torch.tensor([0, 64, 64, 256, 5, 0, 64]).cumsum(0)
    total = int(cu[-1])
    q = (3 * torch.randn(total, heads, dim, generator=gen)).bfloat16()
    k = (3 * torch.randn(total, kv_heads, dim, generator=gen)).bfloat16()
    v = torch.randn(total, kv_heads, dim, generator=gen).bfloat16()
    out = KERNELS.self_attention(q, k, v, torch.empty_like(q), cu, dim**-0.5, causal)
    want = sdpa_per_piece(q, k, v, cu, dim**-0.5, causal, upcast=True)
    theirs = (sdpa_per_piece(q, k, v, cu, dim**-0.5, causal, upcast=False) - want).abs()
    ours = (out.float() - want).abs()
    assert ours.max() <= theirs.max() + 2**-8 * want.abs().max()
    assert ours.mean() <= 1.05 * theirs.mean()


@requires_prefill
def test_self_attention_refuses_offsets_that_do_not_cut_the_rows():
    q = torch.zeros(10, 4, 32, dtype=torch.bfloat16)
    for cu in ([0, 4, 9], [1, 10], [0, 6, 4, 10]):
        with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to 10"):
            KERNELS.self_attention(q, q, q, torch.empty_like(q), torch.tensor(cu), 1.0)


LM_HEAD = KERNELS is not None and KERNELS.has_avx512_bf16
requires_lm_head = pytest.mark.skipif(not LM_HEAD, reason="no AVX-512 BF16 LM head kernel here")


# (rows, dim, vocab) the head kernels are checked at
HEAD_SHAPES = [
    (1, 64, 16),  # one row, one block
    (13, 256, 1000),  # 8 + 4 + 1 rows a pass; the last block 8 columns wide
    (16, 128, 4099),  # a whole pass; 3 columns in the last block
    (37, 2048, 515),  # 2 passes of 16 and 4 + 1; a wide hidden size
]


@requires_lm_head
@pytest.mark.parametrize(
    "rows,dim,vocab",
    [*HEAD_SHAPES, (5, 6, 33)],  # a hidden size that is no multiple of 16
)
def test_lm_head_is_as_accurate_as_a_bf16_linear(rows, dim, vocab):
    """Against float32 on the same bf16 inputs, the head's logits are within one bf16 step of
    what ``F.linear`` in bf16 gives (float32 sums rounded once, in another order); its maxima
    are ``row_max`` of its own logits exactly."""
    from services.language.engine.sampling import row_max

    gen = torch.Generator().manual_seed(rows * dim + vocab)
    weight = (torch.randn(vocab, dim, generator=gen) * dim**-0.5).bfloat16()
    x = torch.randn(rows, dim, generator=gen).bfloat16()
    packed = KERNELS.pack_lm_head(weight)
    logits = KERNELS.lm_head_logits(x, packed, vocab)
    want = x.float() @ weight.float().T
    theirs = (torch.nn.functional.linear(x, weight).float() - want).abs()
    ours = (logits.float() - want).abs()
    assert logits.shape == (rows, vocab) and logits.dtype == torch.bfloat16
    assert ours.max() <= theirs.max() + 2**-8 * want.abs().max()
    values, indices = KERNELS.lm_head_maxima(x, packed, vocab)
    want_values, want_indices = row_max(logits)
    assert torch.equal(indices, want_indices) and torch.equal(values, want_values.float())


@requires_lm_head
def test_lm_head_maxima_take_the_first_of_equal_logits_and_flag_non_finite_rows():
    dim, vocab = 32, 70
    weight = torch.zeros(vocab, dim, dtype=torch.bfloat16)
    weight[[5, 21, 69], 0] = 1.0  # three columns tie for the maximum, in three blocks
    weight[40, 1] = 1.0
    x = torch.zeros(4, dim, dtype=torch.bfloat16)
    x[0, 0] = 2.0  # columns 5, 21, 69 all 2: the first one
    x[1, 1] = 3.0  # column 40 alone
    x[2, 0] = float("nan")  # NaN logits
    x[3, 1] = float("inf")  # +inf at column 40
    values, indices = KERNELS.lm_head_maxima(x, KERNELS.pack_lm_head(weight), vocab)
    assert indices[:2].tolist() == [5, 40] and values[:2].tolist() == [2.0, 3.0]
    assert values[2:].isnan().all()


@requires_lm_head
def test_lm_head_reads_rows_of_a_wider_tensor_and_refuses_a_mismatched_head():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(50, 64, generator=gen).bfloat16()
    wide = torch.randn(6, 96, generator=gen).bfloat16()
    packed = KERNELS.pack_lm_head(weight)
    got = KERNELS.lm_head_logits(wide[:, :64], packed, 50)
    assert torch.equal(got, KERNELS.lm_head_logits(wide[:, :64].contiguous(), packed, 50))
    with pytest.raises(ValueError, match="do not match the packed head"):
        KERNELS.lm_head_logits(wide[:, :32], packed, 50)
    with pytest.raises(ValueError, match="pack_lm_head takes bf16"):
        KERNELS.pack_lm_head(torch.zeros(4, 7, dtype=torch.bfloat16))
    assert KERNELS.lm_head_fits(torch.bfloat16, 64)
    assert not KERNELS.lm_head_fits(torch.float32, 64)
    assert not KERNELS.lm_head_fits(torch.bfloat16, 7)


SCREEN = LM_HEAD and KERNELS.has_head_screen
requires_screen = pytest.mark.skipif(not SCREEN, reason="no AVX-512 VNNI head screen here")


def screened_and_full(x, weight):
    vocab = weight.shape[0]
    packed = KERNELS.pack_lm_head(weight)
    screen = KERNELS.pack_lm_head_screen(weight)
    assert screen is not None
    return KERNELS.lm_head_screened(x, packed, screen, vocab), KERNELS.lm_head_maxima(
        x, packed, vocab
    )


@requires_screen
# the narrowest dim; two quantization groups of 128 dimensions, the second of one quad
@pytest.mark.parametrize("rows,dim,vocab", [*HEAD_SHAPES, (3, 4, 33), (5, 132, 300)])
@pytest.mark.parametrize(
    "weights", ["gaussian", "heavy-tailed", "rows of mixed scale", "groups of zeros"]
)
def test_screened_head_gives_the_full_pass_choice_bit_for_bit(rows, dim, vocab, weights):
    """The int8 screen, then the bf16 pass over the blocks it cannot rule out: each row's
    largest logit and its first column are the full pass's exactly, over seeds and weight
    shapes (outliers make the int8 steps coarse, rows of very different norms, quantization
    groups whose scale is zero on either side)."""
    for seed in range(8):
        gen = torch.Generator().manual_seed(seed * 7919 + rows * dim + vocab)
        weight = torch.randn(vocab, dim, generator=gen) * dim**-0.5
        x = torch.randn(rows, dim, generator=gen)
        if weights == "heavy-tailed":
            weight = weight**3
        elif weights == "rows of mixed scale":
            x = x * torch.logspace(-3, 3, rows)[:, None]
        elif weights == "groups of zeros":
            weight[::2, :128] = 0.0  # every other column's first group
            x[1::2, 128:] = 0.0  # every other row's groups past the first
            x[::3, :4] *= 1e4  # and an outlier in a row's first quad
        (values, indices, rechecked), (want_values, want_indices) = screened_and_full(
            x.bfloat16(), weight.bfloat16()
        )
        assert torch.equal(indices, want_indices) and torch.equal(values, want_values)
        assert rechecked is not None and rows <= rechecked <= rows * -(-vocab // 16)


@requires_screen
def test_screened_head_keeps_the_first_of_ties_and_runs_the_full_pass_where_it_cannot_bound():
    dim, vocab = 32, 70
    weight = torch.zeros(vocab, dim, dtype=torch.bfloat16)
    weight[[5, 21, 69], 0] = 1.0  # three columns tie for the maximum, in three blocks
    weight[40, 1] = 1.0
    weight[:, 2] = 0.25  # every logit of row 1 nonzero
    x = torch.zeros(2, dim, dtype=torch.bfloat16)
    x[0, 0] = 2.0  # columns 5, 21, 69 all 2: the first one
    x[1, 1], x[1, 2] = 3.0, 1.0  # column 40 alone
    (values, indices, rechecked), _ = screened_and_full(x, weight)
    assert indices.tolist() == [5, 40] and values.tolist() == [2.0, 3.25]
    assert rechecked is not None
    for row, why in [
        (float("nan"), "a NaN input"),
        (float("inf"), "an infinite input"),
        (0.0, "a row of zeros (every logit ties)"),
        (1e37, "sums that could overflow float32"),
    ]:
        x = torch.full((1, dim), row, dtype=torch.bfloat16)
        (values, indices, rechecked), (want_values, want_indices) = screened_and_full(x, weight)
        assert rechecked is None, why
        assert torch.equal(indices, want_indices), why
        assert torch.equal(values, want_values) or (values.isnan() & want_values.isnan()).all()


@requires_screen
def test_screened_head_takes_subnormal_inputs_as_zero_as_the_full_pass_does():
    """VDPBF16PS reads a subnormal bf16 as zero: a row of subnormals against large weights has
    every logit 0 in the full pass (the first column wins), and the screen must bound those
    logits, not the products of the subnormals themselves."""
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(500, 64, generator=gen) * 1e8).bfloat16()
    x = (torch.randn(2, 64, generator=gen) * 1e-39).bfloat16()
    x[1, :8] = 1.0  # a normal row but for its subnormal tail
    assert (x.float().abs() < torch.finfo(torch.float32).tiny).sum() >= 100
    weight[7, 40:] = (torch.randn(24, generator=gen) * 1e-39).bfloat16()  # subnormal weights
    (values, indices, _), (want_values, want_indices) = screened_and_full(x, weight)
    assert want_indices[0] == 0 and want_values[0] == 0.0
    assert torch.equal(indices, want_indices) and torch.equal(values, want_values)


@requires_screen
def test_screened_head_gives_up_on_a_row_that_keeps_too_many_columns():
    """5,000 equal columns all reach the best lower end: more than a thread keeps; the call
    runs the full pass (the first of them wins)."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(6000, 64, generator=gen).bfloat16()
    weight[1000:] = weight[999]
    x = weight[999:1000].clone()
    (values, indices, rechecked), (want_values, want_indices) = screened_and_full(x, weight)
    assert rechecked is None
    assert indices.tolist() == want_indices.tolist() == [999]
    assert torch.equal(values, want_values)


@requires_screen
def test_head_screen_is_made_only_where_it_can_bound_the_weight():
    assert KERNELS.pack_lm_head_screen(torch.zeros(8, 6, dtype=torch.bfloat16)) is None  # dim
    assert KERNELS.pack_lm_head_screen(torch.zeros(8, 8)) is None  # float32
    weight = torch.ones(8, 8, dtype=torch.bfloat16)
    weight[3, 3] = float("inf")
    assert KERNELS.pack_lm_head_screen(weight) is None
    screen = KERNELS.pack_lm_head_screen(torch.ones(20, 8, dtype=torch.bfloat16))
    assert screen.weight.numel() == 32 * 8 and screen.nbytes == 32 * 8 + 2 * 48 * 4
    packed = KERNELS.pack_lm_head(torch.ones(40, 8, dtype=torch.bfloat16))  # another head
    with pytest.raises(ValueError, match="do not match the head's screen"):
        KERNELS.lm_head_screened(torch.ones(1, 8).bfloat16(), packed, screen, 40)


@requires_screen
def test_the_head_screens_while_rows_recheck_few_blocks_and_tries_again_later():
    """``NativeLMHead.maxima``: the screen while its rows would recheck at most
    ``SCREEN_SHARE`` of the head; on a head where every column ties, a screened call gives up,
    so the head stops screening and tries again after ``SCREEN_RETRY`` calls. Its answers are
    the full pass's."""
    from services.language.model import lm_head
    from services.language.model.lm_head import NativeLMHead

    class Counting:  # the real kernels, their screened calls counted
        def __init__(self):
            self.screened = 0

        def __getattr__(self, name):
            return getattr(KERNELS, name)

        def lm_head_screened(self, *args):
            self.screened += 1
            return KERNELS.lm_head_screened(*args)

    gen = torch.Generator().manual_seed(11)
    native = Counting()
    distinct = NativeLMHead(torch.randn(4000, 64, generator=gen).bfloat16(), native)
    x = torch.randn(16, 64, generator=gen).bfloat16()
    for _ in range(5):
        assert all(map(torch.equal, distinct.maxima(x), distinct.native.lm_head_maxima(
            x, distinct.packed_weight, 4000)))  # fmt: skip
    assert native.screened == 5 and distinct.rechecked_per_row < 16

    native = Counting()
    # every logit ties: more columns kept than a thread has room for, even with 16 threads
    tied = NativeLMHead(torch.ones(40000, 64).bfloat16(), native)
    want = tied.native.lm_head_maxima(x[:1], tied.packed_weight, 40000)
    for _ in range(lm_head.SCREEN_RETRY + 1):
        assert all(map(torch.equal, tied.maxima(x[:1]), want))
    assert native.screened == 2  # the first call, then one try after SCREEN_RETRY calls


@requires_lm_head
@pytest.mark.parametrize(
    "rows,dim,n,bias",
    [
        (1, 64, 48, True),  # one row
        (16, 256, 520, True),  # a whole pass; 8 columns in the last block
        (300, 128, 96, False),  # two panels of rows (256, then 44)
        (37, 2048, 256, False),  # a wide input
    ],
)
def test_linear_is_as_accurate_as_a_bf16_linear(rows, dim, n, bias):
    """The decoder's linear on the head's packed blocks: within one bf16 step of what
    ``F.linear`` in bf16 gives against float32 (the bias added before the rounding), for rows of
    a wider tensor as for contiguous ones."""
    gen = torch.Generator().manual_seed(rows + dim + n)
    weight = (torch.randn(n, dim, generator=gen) * dim**-0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    wide = torch.randn(rows, dim + 32, generator=gen).bfloat16()
    x = wide[:, :dim]
    packed = KERNELS.pack_lm_head(weight)
    got = KERNELS.linear(x, packed, n, b)
    want = x.float() @ weight.float().T + (0 if b is None else b.float())
    theirs = (torch.nn.functional.linear(x, weight, b).float() - want).abs()
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= theirs.max() + 2**-8 * want.abs().max()
    assert torch.equal(got, KERNELS.linear(x.contiguous(), packed, n, b))
    assert KERNELS.linear(x[None], packed, n, b).shape == (1, rows, n)  # leading dimensions
    with pytest.raises(ValueError, match="do not match the packed weight"):
        KERNELS.linear(wide[:, : dim // 2], packed, n, b)
