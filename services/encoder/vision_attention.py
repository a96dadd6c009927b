"""Vision attention over a batch of images in a few kernel calls instead of one per piece.

transformers' Qwen-VL vision attention, without a flash-attention kernel installed, cuts the
batch at every image (and, in Qwen2.5-VL's windowed layers, at every window) and calls SDPA once
per piece: a 448² image is 16 windows, so a batch of 16 images makes 256 calls in each windowed
layer, and the Python around each call costs more than the small attention it runs. Pieces of
the same length are independent problems of one shape: ``grouped_attention`` stacks each run of
equal-length pieces into one batched SDPA call, the same arithmetic per piece (tested equal to
the per-piece path, bit for bit).

It is handed to the tower through transformers' own attention registry, under a name with
"flash" in it: that is how transformers recognises a variable-length kernel and passes it the
batch's ``cu_seqlens`` instead of cutting the batch itself.
"""

from __future__ import annotations

import torch
from torch.nn import functional

GROUPED_ATTENTION = "epd_grouped_flash"  # "flash": transformers passes it cu_seqlens


def grouped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Bidirectional attention within each piece of ``query``/``key``/``value``
    ``[1, heads, S, head_dim]`` that ``cu_seq_lens_q`` (``[num_pieces + 1]`` offsets) cuts;
    returns ``[1, S, heads, head_dim]`` as transformers' kernels do."""
    if attention_mask is not None or cu_seq_lens_q is None or query.shape[0] != 1:
        raise ValueError("grouped_attention takes one unmasked sequence cut by cu_seq_lens_q")
    lengths = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()
    heads, head_dim = query.shape[1], query.shape[3]
    outputs = []
    start = first = 0
    while first < len(lengths):
        last = first
        while last < len(lengths) and lengths[last] == lengths[first]:
            last += 1
        num, length = last - first, lengths[first]
        end = start + num * length
        q, k, v = (_pieces(t, start, end, num, length) for t in (query, key, value))
        out = functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling)
        outputs.append(out.transpose(1, 2).reshape(num * length, heads, head_dim))
        start, first = end, last
    return torch.cat(outputs).unsqueeze(0), None


def _pieces(t: torch.Tensor, start: int, end: int, num: int, length: int) -> torch.Tensor:
    """Rows ``start:end`` of ``t`` ``[1, heads, S, head_dim]`` as ``num`` pieces of ``length``:
    ``[num, heads, length, head_dim]``."""
    return t[0, :, start:end].unflatten(1, (num, length)).transpose(0, 1)


def use_grouped_attention(tower: torch.nn.Module) -> bool:
    """Make ``tower`` (a transformers Qwen-VL vision model) attend with ``grouped_attention``;
    False (nothing changed) when its configuration asks for another kernel than SDPA."""
    from transformers import AttentionInterface

    config = tower.config
    if config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(GROUPED_ATTENTION, grouped_attention)
    config._attn_implementation = GROUPED_ATTENTION
    return True
