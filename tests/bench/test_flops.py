"""The analytic work counts of ``bench.flops`` against torch's own FLOP counter on small models."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.flops import VitShape, kv_bytes, prefill_flops, vit_flops
from services.language.model.config import TextModelConfig

ATTENTION_OPS = ("bmm",)  # eager attention: the only batched matmuls


def _counted(fn) -> tuple[int, int]:
    """(dense, attention) FLOPs torch counts while ``fn`` runs."""
    with FlopCounterMode(display=False) as counter:
        fn()
    dense = attention = 0
    for op, flops in counter.get_flop_counts()["Global"].items():
        if any(name in str(op) for name in ATTENTION_OPS):
            attention += flops
        else:
            dense += flops
    return dense, attention


def _vision(arch: str):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    from transformers.models.qwen2_vl import modeling_qwen2_vl
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    common = dict(depth=3, num_heads=2, spatial_merge_size=2, temporal_patch_size=2)
    if arch == "qwen2_vl":
        config = Qwen2VLConfig(
            vision_config=dict(common, embed_dim=32, hidden_size=48, mlp_ratio=2)
        )
        module = modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel
    elif arch == "qwen2_5_vl":
        vision = dict(common, hidden_size=32, intermediate_size=40, out_hidden_size=48)
        vision.update(patch_size=14, window_size=112, fullatt_block_indexes=[1])
        config = Qwen2_5_VLConfig(vision_config=vision)
        module = modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel
    else:
        vision = dict(common, hidden_size=32, intermediate_size=40, out_hidden_size=48)
        vision.update(patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0, 2])
        config = Qwen3VLConfig(vision_config=vision)
        module = modeling_qwen3_vl.Qwen3VLVisionModel
    vc = config.vision_config
    vc._attn_implementation = "eager"  # matmuls: torch counts them (not CPU flash)
    return vc, module._from_config(vc).eval()


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_vit_count_matches_torch(arch: str) -> None:
    vc, model = _vision(arch)
    # one frame whose merged grid is not a multiple of the window (edge windows are smaller)
    # and a second image, so per-image attention spans are exercised
    grids = [(1, 20, 28), (1, 12, 8)]
    num_patches = sum(t * h * w for t, h, w in grids)
    patch_in = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    pixels = torch.randn(num_patches, patch_in)
    with torch.inference_mode():
        dense, attention = _counted(lambda: model(pixels, grid_thw=torch.tensor(grids)))
    count = vit_flops(VitShape.from_config(vc), grids)
    assert (count.dense, count.attention) == (dense, attention)


def _text_config(**overrides) -> TextModelConfig:
    fields = dict(
        model_type="qwen2_5_vl", vocab_size=500, hidden_size=64, intermediate_size=96,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=1e6, mrope_section=(2, 3, 3), mrope_interleaved=False, qk_norm=False,
        attention_bias=False, tie_word_embeddings=True, num_deepstack=0, eos_token_ids=(1,),
    )  # fmt: skip
    fields.update(overrides)
    return TextModelConfig(**fields)


def test_prefill_count_matches_torch() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = _text_config()
    hf = Qwen3Config(  # same projections and MLP as the Qwen-VL decoder (q/k norms cost no mm)
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, tie_word_embeddings=True, attn_implementation="eager",
    )  # fmt: skip
    model = Qwen3ForCausalLM(hf).eval()
    num_tokens = 24
    ids = torch.randint(0, config.vocab_size, (1, num_tokens))
    with torch.inference_mode():
        dense, square = _counted(lambda: model(input_ids=ids, logits_to_keep=1))
    count = prefill_flops(config, num_tokens)
    assert count.dense == dense
    # torch counts a causal attention as the full square; we count the lower triangle
    assert count.attention * 2 * num_tokens == square * (num_tokens + 1)


def test_kv_bytes() -> None:
    config = _text_config(num_layers=3, num_kv_heads=2, head_dim=8)
    assert kv_bytes(config, 10, 4) == 2 * 3 * 2 * 8 * 10 * 4
