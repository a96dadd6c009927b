"""The shapes of real Qwen-VL checkpoints and their Hub-style configuration files.

``HUB_SPECS`` holds the published sizes of Qwen2-VL-2B, Qwen2.5-VL-3B and Qwen3-VL-2B.
``hub_config`` renders a spec as the ``config.json`` those repositories ship: the legacy flat
layout for Qwen2-VL / Qwen2.5-VL (text fields at the top level, ``vision_config`` nested,
``rope_scaling.mrope_section``) and the nested ``text_config`` / ``vision_config`` layout of
Qwen3-VL. ``preprocessor_config`` and ``generation_config`` follow the same repositories' files
(minus their sampling defaults, so a plain ``generate`` call is greedy).

``with_depth`` keeps a spec's widths with fewer layers: Qwen3-VL's deepstack taps are scaled to the
new depth, and Qwen2.5-VL keeps one full-attention block per period of its window blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# The Qwen2 tokenizer's special-token ids (the same in every Qwen-VL repository).
QWEN_TOKEN_IDS = {
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
}
ENDOFTEXT_ID = 151643
ARCHITECTURES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
}


@dataclass(frozen=True)
class HubSpec:
    """Sizes of one checkpoint, named as the Hub configs name them."""

    name: str
    arch: str  # qwen2_vl | qwen2_5_vl | qwen3_vl
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    mrope_section: tuple[int, int, int]
    max_position_embeddings: int
    tie_word_embeddings: bool
    vision_depth: int
    vision_hidden: int
    vision_intermediate: int  # Qwen2-VL: embed_dim * mlp_ratio
    vision_heads: int
    patch_size: int
    deepstack_indexes: tuple[int, ...] = ()  # Qwen3-VL
    fullatt_indexes: tuple[int, ...] = ()  # Qwen2.5-VL
    num_position_embeddings: int = 0  # Qwen3-VL

    @property
    def num_deepstack(self) -> int:
        return len(self.deepstack_indexes)


HUB_SPECS = {
    "qwen2_vl": HubSpec(
        "Qwen2-VL-2B", "qwen2_vl", 151936, 1536, 8960, 28, 12, 2, 128, 1_000_000.0,
        (16, 24, 24), 32768, True, 32, 1280, 5120, 16, 14,
    ),
    "qwen2_5_vl": HubSpec(
        "Qwen2.5-VL-3B", "qwen2_5_vl", 151936, 2048, 11008, 36, 16, 2, 128, 1_000_000.0,
        (16, 24, 24), 128000, True, 32, 1280, 3420, 16, 14, fullatt_indexes=(7, 15, 23, 31),
    ),
    "qwen3_vl": HubSpec(
        "Qwen3-VL-2B", "qwen3_vl", 151936, 2048, 6144, 28, 16, 8, 128, 5_000_000.0,
        (24, 20, 20), 262144, True, 24, 1024, 4096, 16, 16, deepstack_indexes=(5, 11, 17),
        num_position_embeddings=2304,
    ),
}  # fmt: skip


def with_depth(spec: HubSpec, num_layers: int, vision_depth: int) -> HubSpec:
    """``spec``'s widths with ``num_layers`` text layers and ``vision_depth`` vision blocks."""
    if num_layers < 1 or vision_depth < 1:
        raise ValueError("a model needs at least one text layer and one vision block")

    def scale(indexes: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(i * vision_depth // spec.vision_depth for i in indexes)

    deepstack = scale(spec.deepstack_indexes)
    if len(set(deepstack)) != len(deepstack):
        raise ValueError(f"{vision_depth} vision blocks cannot hold {spec.num_deepstack} taps")
    fullatt = spec.fullatt_indexes
    if fullatt:  # every period-th block attends globally; the last one at least
        period = spec.vision_depth // len(fullatt)
        fullatt = tuple(i for i in range(vision_depth) if (i + 1) % period == 0)
        fullatt = fullatt or (vision_depth - 1,)
    suffix = f"-{num_layers}L{vision_depth}V"
    return replace(
        spec,
        name=spec.name + suffix,
        num_layers=num_layers,
        vision_depth=vision_depth,
        deepstack_indexes=deepstack,
        fullatt_indexes=fullatt,
    )


def _vision_config(spec: HubSpec) -> dict:
    if spec.arch == "qwen2_vl":
        return {
            "depth": spec.vision_depth,
            "embed_dim": spec.vision_hidden,
            "mlp_ratio": spec.vision_intermediate // spec.vision_hidden,
            "num_heads": spec.vision_heads,
            "in_chans": 3,
            "hidden_size": spec.hidden_size,
            "patch_size": spec.patch_size,
            "spatial_merge_size": 2,
            "spatial_patch_size": spec.patch_size,
            "temporal_patch_size": 2,
        }
    if spec.arch == "qwen2_5_vl":
        return {
            "depth": spec.vision_depth,
            "hidden_act": "silu",
            "hidden_size": spec.vision_hidden,
            "intermediate_size": spec.vision_intermediate,
            "num_heads": spec.vision_heads,
            "in_chans": 3,
            "out_hidden_size": spec.hidden_size,
            "patch_size": spec.patch_size,
            "spatial_merge_size": 2,
            "spatial_patch_size": spec.patch_size,
            "window_size": 112,
            "fullatt_block_indexes": list(spec.fullatt_indexes),
            "tokens_per_second": 2,
            "temporal_patch_size": 2,
        }
    return {
        "deepstack_visual_indexes": list(spec.deepstack_indexes),
        "depth": spec.vision_depth,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": spec.vision_hidden,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": spec.vision_intermediate,
        "model_type": "qwen3_vl",
        "num_heads": spec.vision_heads,
        "num_position_embeddings": spec.num_position_embeddings,
        "out_hidden_size": spec.hidden_size,
        "patch_size": spec.patch_size,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }


def hub_config(spec: HubSpec, token_ids: dict[str, int] | None = None) -> dict:
    """The ``config.json`` of ``spec`` in its repository's layout (flat, or nested for Qwen3)."""
    ids = dict(QWEN_TOKEN_IDS if token_ids is None else token_ids)
    text = {
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "use_cache": True,
        "vocab_size": spec.vocab_size,
    }
    top = {"architectures": [ARCHITECTURES[spec.arch]], "model_type": spec.arch}
    if spec.arch == "qwen3_vl":
        text.update(
            attention_bias=False,
            bos_token_id=ids["bos_token_id"],
            dtype="bfloat16",
            eos_token_id=ids["eos_token_id"],
            head_dim=spec.head_dim,
            model_type="qwen3_vl_text",
            rope_scaling={
                "mrope_interleaved": True,
                "mrope_section": list(spec.mrope_section),
                "rope_type": "default",
            },
        )
        return {
            **top,
            "image_token_id": ids["image_token_id"],
            "text_config": dict(sorted(text.items())),
            "tie_word_embeddings": spec.tie_word_embeddings,
            "video_token_id": ids["video_token_id"],
            "vision_config": _vision_config(spec),
            "vision_end_token_id": ids["vision_end_token_id"],
            "vision_start_token_id": ids["vision_start_token_id"],
        }
    if spec.head_dim * spec.num_heads != spec.hidden_size:
        raise ValueError(f"{spec.name}: Qwen2 layouts need head_dim * num_heads == hidden_size")
    return {
        **top,
        **ids,
        **text,
        "attention_dropout": 0.0,
        "max_window_layers": spec.num_layers,
        "sliding_window": 32768,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "vision_config": _vision_config(spec),
        "rope_scaling": {"type": "mrope", "mrope_section": list(spec.mrope_section)},
    }


def preprocessor_config(arch: str) -> dict:
    """The image processor's ``preprocessor_config.json`` as the arch's repositories ship it."""
    if arch == "qwen3_vl":
        return {
            "size": {"longest_edge": 16777216, "shortest_edge": 65536},
            "patch_size": 16,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "processor_class": "Qwen3VLProcessor",
            "image_processor_type": "Qwen2VLImageProcessorFast",
        }
    return {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor" if arch == "qwen2_vl" else "Qwen2_5_VLProcessor",
    }


def generation_config(token_ids: dict[str, int] | None = None, pad_token_id: int = ENDOFTEXT_ID):
    """``generation_config.json``: the stop ids (``<|im_end|>`` and ``<|endoftext|>``)."""
    ids = QWEN_TOKEN_IDS if token_ids is None else token_ids
    return {
        "bos_token_id": ids["bos_token_id"],
        "pad_token_id": pad_token_id,
        "eos_token_id": [ids["eos_token_id"], pad_token_id],
    }
