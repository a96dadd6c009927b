"""Analytic work counts for ``bench.limits``: ViT and prefill FLOPs, decode bytes per step.

A FLOP is one multiply or one add (a multiply-add is 2), the convention of ``torch.mm``'s
``2*m*n*k`` and of ``torch.utils.flop_counter``. Only matrix products are counted (linear
layers, the patch convolution, attention scores and values); norms, activations, rotary
embeddings and softmax are a few FLOPs per element and left out, so an achieved rate computed
from these counts is a slight underestimate.

Attention is counted as computed, not as a dense square: Qwen2.5-VL's windowed ViT blocks attend
within their windows only, full blocks within one frame, and a causal prefill of ``T`` tokens
scores ``T*(T+1)/2`` query-key pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.language.model.config import TextModelConfig


@dataclass(frozen=True)
class FlopCount:
    dense: int  # linear layers and convolutions
    attention: int  # query-key scores and attention-weighted values

    @property
    def total(self) -> int:
        return self.dense + self.attention


@dataclass(frozen=True)
class VitShape:
    """The ViT sizes that decide its work, read from a Qwen-VL ``vision_config``."""

    hidden: int  # width of the blocks
    intermediate: int  # MLP width
    num_mlp_mats: int  # 3 for a gated (SwiGLU) MLP, 2 for fc1/fc2
    depth: int
    patch_in: int  # values per patch: channels * temporal_patch * patch**2
    merge: int  # spatial_merge_size
    merger_out: int  # width of the rows the merger emits (the LLM's hidden size)
    num_mergers: int  # the main merger plus Qwen3-VL's deepstack mergers
    window_merged: int  # window side in merged units (0: every block attends the whole frame)
    full_blocks: frozenset[int]  # blocks that attend the whole frame when windowed

    @classmethod
    def from_config(cls, vc: Any) -> VitShape:
        """From a transformers vision config (or a namespace with the same fields)."""
        patch = vc.patch_size
        patch_in = vc.in_channels * vc.temporal_patch_size * patch * patch
        model_type = getattr(vc, "model_type", "")
        if model_type == "qwen2_vl" or hasattr(vc, "embed_dim"):  # Qwen2-VL: fc1/fc2, no windows
            hidden = vc.embed_dim
            return cls(
                hidden, int(hidden * vc.mlp_ratio), 2, vc.depth, patch_in, vc.spatial_merge_size,
                vc.hidden_size, 1, 0, frozenset(),
            )  # fmt: skip
        window = getattr(vc, "window_size", 0) or 0
        deepstack = len(getattr(vc, "deepstack_visual_indexes", None) or ())
        windowed = bool(window) and hasattr(vc, "fullatt_block_indexes")
        return cls(
            hidden=vc.hidden_size,
            intermediate=vc.intermediate_size,
            num_mlp_mats=3 if windowed else 2,  # Qwen2.5-VL gates its MLP, Qwen3-VL does not
            depth=vc.depth,
            patch_in=patch_in,
            merge=vc.spatial_merge_size,
            merger_out=vc.out_hidden_size,
            num_mergers=1 + deepstack,
            window_merged=window // vc.spatial_merge_size // patch if windowed else 0,
            full_blocks=frozenset(vc.fullatt_block_indexes) if windowed else frozenset(),
        )


def _window_lengths(shape: VitShape, grid_h: int, grid_w: int) -> list[int]:
    """Patches in each attention window of one frame (windows tile the merged grid)."""
    side = shape.window_merged
    merged_h, merged_w = grid_h // shape.merge, grid_w // shape.merge
    lengths = []
    for top in range(0, merged_h, side):
        for left in range(0, merged_w, side):
            rows, cols = min(side, merged_h - top), min(side, merged_w - left)
            lengths.append(rows * cols * shape.merge**2)
    return lengths


def vit_flops(shape: VitShape, grids: list[tuple[int, int, int]]) -> FlopCount:
    """FLOPs of one ViT forward over images with patch grids ``(t, h, w)``."""
    d = shape.hidden
    dense = attention = 0
    for t, h, w in grids:
        n = t * h * w
        frame = h * w
        per_block = 2 * n * d * (3 * d + d + shape.num_mlp_mats * shape.intermediate)
        full = t * frame * frame
        windowed = (
            t * sum(x * x for x in _window_lengths(shape, h, w)) if shape.window_merged else 0
        )
        for block in range(shape.depth):
            pairs = full if not shape.window_merged or block in shape.full_blocks else windowed
            attention += 2 * 2 * pairs * d  # scores q.k, then weights times v
        wide = d * shape.merge**2
        merger = 2 * (n // shape.merge**2) * wide * (wide + shape.merger_out)
        dense += 2 * n * shape.patch_in * d + shape.depth * per_block + shape.num_mergers * merger
    return FlopCount(dense, attention)


def prefill_flops(config: TextModelConfig, num_tokens: int) -> FlopCount:
    """FLOPs of a causal prefill of ``num_tokens`` new tokens (nothing cached), logits of the
    last token only (the LM head over the vocabulary once)."""
    h, hd = config.hidden_size, config.head_dim
    q_width, kv_width = config.num_heads * hd, config.num_kv_heads * hd
    per_token = 2 * (
        h * q_width + 2 * h * kv_width + q_width * h + 3 * h * config.intermediate_size
    )
    dense = config.num_layers * per_token * num_tokens + 2 * h * config.vocab_size
    pairs = num_tokens * (num_tokens + 1) // 2
    attention = config.num_layers * 2 * 2 * pairs * q_width
    return FlopCount(dense, attention)


def kv_bytes(config: TextModelConfig, num_tokens: int, element_size: int) -> int:
    """Bytes of the keys and values of ``num_tokens`` tokens over all layers."""
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    return per_token * num_tokens * element_size


def decode_bytes(weight_bytes: int, config: TextModelConfig, context: int, element_size: int):
    """Bytes one batch-1 decode step must read: every weight it uses once (``weight_bytes``)
    and the KV cache of ``context`` tokens."""
    return weight_bytes + kv_bytes(config, context, element_size)
