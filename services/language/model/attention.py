"""Attention of a flat batch over the paged KV pool with ``scaled_dot_product_attention``.

In bf16 on a CPU with AVX-512 BF16 (``prefill_attention`` ``auto`` / ``native``), prefill chunks
attend with the native causal kernel instead (``NativeKernels.prefill_attention``: the prefix
length is its causal offset, no mask; ~2.4x SDPA here). What follows is the SDPA path, the
reference, which it replaces for prefill chunks only.

Prefill chunks attend causally with an offset: query ``i`` of a chunk that follows
``prefix_len`` cached tokens sees keys ``0 .. prefix_len + i`` (an additive key bias made once
per step, ``ExtendSegment.kv_bias``). Decode tokens see all their keys; each group of decode
requests of similar KV length (``DecodeGroup``) is padded into one call with an additive key
mask (-inf at the pads), so a long request does not pad the short ones of other groups to its
length. Keys held in one run of slots (``batch.slot_run``: a long request alone, usually) are
a slice of the pool, read in place; others are gathered. A decode query is one token, so the
``heads / kv_heads`` query heads that share a KV head are laid out as that head's query rows:
SDPA then reads each K/V head once instead of a copy repeated per query head (GQA).

On a CPU with the native kernels, where they are the faster path (``DecodeRows``; GQA groups of
up to 4 query heads, 8 in bf16 on AVX-512 BF16), the decode tokens attend to their keys in the
pool in place instead: one C call per layer for all of them, each key row read once per KV head,
no gather, no padding, no mask (1.5-3x faster than the gather and SDPA at the demo checkpoint's
widths).

A prefill chunk after a long cached prefix on a CPU (``ExtendSegment.split_prefix``) attends to
the prefix and to its own keys in two calls of SDPA's CPU kernel, merged by the log-sum-exp each
returns: the prefix without a mask, the query heads that share a KV head laid out as that head's
rows (the prefix's keys read once per KV head), the chunk's own keys causally. No
``[q_len, prefix + q_len]`` mask is built or read: at the demo checkpoint's widths 1.2x faster
from 1024 cached keys and 1.4-1.5x from 2048, at Qwen2.5-VL-3B's even at 1024-2048 and 1.2x
from 4096 (bf16, 2 cores).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from common.native_kernels import NativeKernels
from services.language.model.batch import FLASH_ATTENTION_CPU, ForwardBatch
from services.language.model.config import TextModelConfig

logger = logging.getLogger(__name__)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """``q`` [T, heads, head_dim]; caches [num_slots, kv_heads, head_dim] -> [T, heads, head_dim].

    The K/V of this step's tokens must already be written at ``batch.out_slots``.
    """
    out = torch.empty_like(q)
    for seg in batch.extends:
        span = slice(seg.q_start, seg.q_start + seg.q_len)
        if seg.kernels is not None:
            k = _keys(k_cache, seg.kv_slots, seg.kv_run)
            v = _keys(v_cache, seg.kv_slots, seg.kv_run)
            seg.kernels.prefill_attention(q[span], k, v, out[span], scale)
            continue
        qs = q[span].transpose(0, 1)[None]
        k = _keys(k_cache, seg.kv_slots, seg.kv_run).transpose(0, 1)[None]
        v = _keys(v_cache, seg.kv_slots, seg.kv_run).transpose(0, 1)[None]
        if seg.split_prefix:
            o = _after_prefix(qs, k, v, seg.prefix_len, scale)
        else:
            causal = seg.kv_bias is None  # no prefix
            o = F.scaled_dot_product_attention(
                qs, k, v, attn_mask=seg.kv_bias, is_causal=causal, scale=scale, enable_gqa=True
            )
        out[span] = o[0].transpose(0, 1)
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    rows = batch.decode_rows
    if rows is not None:
        out[: rows.num_rows] = rows.kernels.decode_attention(
            q[: rows.num_rows], k_cache, v_cache, rows.slots, rows.offsets, rows.max_len, scale
        )
    for group in batch.decode_groups:
        num, max_len = group.kv_slots.shape
        rows = slice(group.row_start, group.row_start + num)
        qd = q[rows].view(num, kv_heads, -1, head_dim)  # [n, kv_heads, heads / kv_heads, head_dim]
        flat = group.kv_slots.view(-1)
        k = (
            _keys(k_cache, flat, group.kv_run)
            .view(num, max_len, kv_heads, head_dim)
            .transpose(1, 2)
        )
        v = (
            _keys(v_cache, flat, group.kv_run)
            .view(num, max_len, kv_heads, head_dim)
            .transpose(1, 2)
        )
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=group.kv_bias, scale=scale)
        out[rows] = o.reshape(num, -1, head_dim)
    return out


def _after_prefix(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """Causal attention of a chunk's queries ``q`` [1, heads, q_len, dim] over ``k`` / ``v``
    [1, kv_heads, prefix_len + q_len, dim], the prefix and the chunk's own keys attended apart
    and merged by their log-sum-exp (see the module doc)."""
    _, heads, q_len, dim = q.shape
    per_kv = heads // k.shape[1]
    rows = q.reshape(1, k.shape[1], per_kv * q_len, dim)  # query head h reads KV head h // per_kv
    o_pre, lse_pre = FLASH_ATTENTION_CPU(
        rows, k[:, :, :prefix_len], v[:, :, :prefix_len], scale=scale
    )
    k_own = k[:, :, prefix_len:].repeat_interleave(per_kv, dim=1)
    v_own = v[:, :, prefix_len:].repeat_interleave(per_kv, dim=1)
    o_own, lse_own = FLASH_ATTENTION_CPU(q, k_own, v_own, is_causal=True, scale=scale)
    # the prefix's share of each row's softmax mass: exp(lse_pre) / (exp(lse_pre) + exp(lse_own))
    share = torch.sigmoid(lse_pre.reshape(1, heads, q_len) - lse_own).to(q.dtype)
    return torch.lerp(o_own, o_pre.reshape(1, heads, q_len, dim), share[..., None])


def _keys(cache: torch.Tensor, slots: torch.Tensor, run: tuple[int, int] | None) -> torch.Tensor:
    """The rows of ``cache`` at ``slots``: a slice when they are one run, else a gather."""
    return cache[run[0] : run[1]] if run is not None else cache.index_select(0, slots)


def prefill_attention_kernels(
    choice: str,
    native: NativeKernels | None,
    device: torch.device,
    dtype: torch.dtype,
    mc: TextModelConfig,
) -> NativeKernels | None:
    """The kernels whose prefill attention the runner takes under the ``prefill_attention``
    setting, or None for SDPA; logs the choice. ``auto`` takes the native kernel where it runs
    (the native CPU kernels loaded, bf16, AVX-512 BF16, a head_dim and GQA group it takes);
    ``native`` raises ``RuntimeError`` naming why where it cannot."""
    why = ""
    if choice == "sdpa":
        why = "as configured"
    elif device.type != "cpu":
        why = f"on {device}"
    elif native is None:
        why = "no native CPU kernels"
    elif not native.attention_fits(dtype, mc.num_heads, mc.num_kv_heads, mc.head_dim):
        isa = "built" if native.has_avx512_bf16 else "absent"
        why = (
            f"the native kernel takes bf16 on a CPU with AVX-512 BF16 and head_dim a multiple of "
            f"16 up to 256 (here {dtype}, {mc.num_heads} heads over {mc.num_kv_heads} KV heads "
            f"of {mc.head_dim}, AVX-512 BF16 {isa})"
        )
    if why:
        if choice == "native":
            raise RuntimeError(f"prefill_attention native: {why}")
        logger.info("prefill attention: SDPA (%s)", why)
        return None
    logger.info("prefill attention: the native kernel (bf16, AVX-512 BF16)")
    return native
