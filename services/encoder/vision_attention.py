"""Vision attention over a batch of images in a few kernel calls instead of one per piece.

transformers' Qwen-VL vision attention, without a flash-attention kernel installed, cuts the
batch at every image (and, in Qwen2.5-VL's windowed layers, at every window) and calls SDPA once
per piece: a 448² image is 16 windows, so a batch of 16 images makes 256 calls in each windowed
layer, and the Python around each call costs more than the small attention it runs. Pieces of
the same length are independent problems of one shape: ``grouped_attention`` stacks each run of
equal-length pieces into one batched SDPA call, the same arithmetic per piece (tested equal to
the per-piece path, bit for bit).

The tower's attention modules get ``attention_forward`` as their ``forward`` (per instance;
the class and other models are untouched): transformers' steps in the same order with the same
arithmetic, the rotary embedding of queries and keys included, but that in fewer passes over
memory (``rotate_qk``: one fp32 copy of both, the half swap as a roll with the sine's sign
folded in, in-place products; bit-equal to ``apply_rotary_pos_emb_vision``, which makes ~14
passes and was a third of a small tower's time). On a CPU in bf16 the native kernel of the same
contract (``common/native_kernels.py``) does it in one pass, bit for bit the same.

With ``native`` kernels given (``vision_attention`` ``auto`` or ``native``: bf16 on a CPU with
AVX-512 BF16), the pieces attend in one C call per layer instead
(``NativeKernels.self_attention``, every piece of the batch, windows and images alike): as
accurate as SDPA in bf16, not bit-equal to it.
Measured on 2 cores (Zen 4, bf16): the demo tower 16.7 -> 13.4 ms per 448² image, the Qwen2.5-VL
widths (head_dim 80) 490 -> 466 ms.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from functools import partial

import torch
from torch.nn import functional

from common.native_kernels import NativeKernels


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


BLOCK_ROWS = 1024  # rows rotated at a time: their fp32 temporaries (~1 MB) stay in the cache


def rotate_qk(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, block_rows: int = BLOCK_ROWS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys of ``qkv`` ``[S, 3, heads, head_dim]`` rotated by ``cos`` / ``sin``
    ``[S, head_dim]``, each ``[S, heads, head_dim]`` in ``qkv``'s dtype: ``x * cos +
    rotate_half(x) * sin`` computed in fp32 as transformers does. ``rotate_half(x)`` is
    ``[-x2, x1]``, i.e. ``x`` rolled by half times ``[-1, 1]``: the sign goes into the sine
    (negation is exact), so every product and sum rounds as transformers' do.

    ``block_rows`` rows at a time: the same element-wise passes, but each over a block whose
    fp32 copy stays in the core's cache instead of a round trip to memory per pass (a 60 s
    clip's 34k patches: ~3x faster)."""
    half = qkv.shape[-1] // 2
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).float()[:, None, None]
    cos = cos.float()[:, None, None]
    out = torch.empty(qkv.shape[0], 2, *qkv.shape[2:], dtype=qkv.dtype, device=qkv.device)
    for start in range(0, qkv.shape[0], block_rows):
        rows = slice(start, start + block_rows)
        x = qkv[rows, :2].to(torch.float32, copy=True)  # [B, 2, heads, head_dim], its own
        swapped = x.roll(half, dims=-1).mul_(signed_sin[rows])
        out[rows] = x.mul_(cos[rows]).add_(swapped)
    return out[:, 0], out[:, 1]


Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def attention_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    rotate: Rotate = rotate_qk,
    native: NativeKernels | None = None,
    **kwargs,
) -> torch.Tensor:
    """A Qwen-VL vision attention module's forward (``self``: the module, which keeps its
    weights): qkv, rotary (``rotate``: ``rotate_qk`` or the native kernel of the same
    contract), attention within the pieces ``cu_seqlens`` cuts (``grouped_attention``, or
    ``native``'s ``self_attention``), output projection."""
    seq_length = hidden_states.shape[0]
    qkv = self.qkv(hidden_states).view(seq_length, 3, self.num_heads, -1)
    cos, sin = position_embeddings
    query, key = rotate(qkv, cos, sin)
    if native is not None:
        out = native.self_attention(
            query, key, qkv[:, 2], torch.empty_like(query), cu_seqlens, self.scaling
        )
        return self.proj(out.reshape(seq_length, -1))
    heads_first = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, qkv[:, 2]))
    out, _ = grouped_attention(self, *heads_first, None, self.scaling, cu_seq_lens_q=cu_seqlens)
    return self.proj(out.reshape(seq_length, -1))


def use_grouped_attention(
    tower: torch.nn.Module, rotate: Rotate = rotate_qk, native: NativeKernels | None = None
) -> bool:
    """Make ``tower``'s (a transformers Qwen-VL vision model) attention modules run
    ``attention_forward`` with ``rotate`` (and ``native``'s attention kernel, when given);
    False (nothing changed) when its configuration asks for another kernel than SDPA or a
    module is not of the shape it knows."""
    if tower.config._attn_implementation != "sdpa":
        return False
    modules = [m for m in tower.modules() if type(m).__name__.endswith("VisionAttention")]
    known = ("qkv", "proj", "num_heads", "scaling")
    if not modules or not all(all(hasattr(m, name) for name in known) for m in modules):
        return False
    for module in modules:
        forward = partial(attention_forward, rotate=rotate, native=native)
        module.forward = types.MethodType(forward, module)
    return True
