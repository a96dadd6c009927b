"""Multimodal rotary embedding (M-RoPE) over 3-axis (t, h, w) positions.

Each frequency index ``i`` of the ``head_dim // 2`` rotary frequencies takes its angle from one
position axis. Qwen2/2.5-VL assign contiguous sections (``[t]*s0 + [h]*s1 + [w]*s2``); Qwen3-VL
interleaves them (``t h w t h w ...`` for the first ``3*s1`` indices, ``t`` after). Text tokens
carry the same value on all three axes, so both reduce to 1-D RoPE there.
"""

from __future__ import annotations

import torch


class MRotaryEmbedding:
    """cos/sin tables for a batch of tokens from their ``[3, T]`` positions."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        mrope_section: tuple[int, ...],
        interleaved: bool,
        device: torch.device,
    ) -> None:
        half = head_dim // 2
        if sum(mrope_section) != half:
            raise ValueError(f"mrope_section {mrope_section} must sum to {half}")
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        self.inv_freq = (1.0 / (theta**exponent)).to(device)
        axis = torch.zeros(half, dtype=torch.long)
        if interleaved:
            for dim in (1, 2):
                axis[dim : mrope_section[dim] * 3 : 3] = dim
        else:
            axis = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        self.axis = axis.to(device)  # [half]: which position axis drives frequency i

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``positions`` [3, T] -> (cos, sin), each [T, 1, head_dim] to broadcast over heads."""
        freqs = positions[..., None].float() * self.inv_freq  # [3, T, half]
        index = self.axis.view(1, 1, -1).expand(1, freqs.shape[1], -1)
        picked = freqs.gather(0, index).squeeze(0)  # [T, half]
        emb = torch.cat((picked, picked), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
