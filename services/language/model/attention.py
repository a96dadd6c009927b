"""Attention of a flat batch over the paged KV pool with ``scaled_dot_product_attention``.

Prefill chunks attend causally with an offset: query ``i`` of a chunk that follows
``prefix_len`` cached tokens sees keys ``0 .. prefix_len + i`` (an additive key bias made once
per step, ``ExtendSegment.kv_bias``). Decode tokens see all their keys; each group of decode
requests of similar KV length (``DecodeGroup``) is padded into one call with an additive key
mask (-inf at the pads), so a long request does not pad the short ones of other groups to its
length. Keys held in one run of slots (``batch.slot_run``: a long request alone, usually) are
a slice of the pool, read in place; others are gathered. A decode query is one token, so the
``heads / kv_heads`` query heads that share a KV head are laid out as that head's query rows:
SDPA then reads each K/V head once instead of a copy repeated per query head (GQA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.language.model.batch import ForwardBatch


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
        qs = q[seg.q_start : seg.q_start + seg.q_len].transpose(0, 1)[None]
        k = _keys(k_cache, seg.kv_slots, seg.kv_run).transpose(0, 1)[None]
        v = _keys(v_cache, seg.kv_slots, seg.kv_run).transpose(0, 1)[None]
        causal = seg.kv_bias is None  # no prefix
        o = F.scaled_dot_product_attention(
            qs, k, v, attn_mask=seg.kv_bias, is_causal=causal, scale=scale, enable_gqa=True
        )
        out[seg.q_start : seg.q_start + seg.q_len] = o[0].transpose(0, 1)
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
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


def _keys(cache: torch.Tensor, slots: torch.Tensor, run: tuple[int, int] | None) -> torch.Tensor:
    """The rows of ``cache`` at ``slots``: a slice when they are one run, else a gather."""
    return cache[run[0] : run[1]] if run is not None else cache.index_select(0, slots)
