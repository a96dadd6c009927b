"""The text-decoder hyper-parameters read from a Hugging Face Qwen-VL ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class TextModelConfig:
    """What the language engine needs to know about the checkpoint's text decoder."""

    model_type: str  # qwen2_vl | qwen2_5_vl | qwen3_vl
    vocab_size: int  # fill ids >= vocab_size are image tokens
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]  # sums to head_dim // 2 (t, h, w)
    mrope_interleaved: bool  # Qwen3-VL: sections interleaved t,h,w,t,h,w,...
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k before RoPE
    attention_bias: bool  # bias on q/k/v projections (Qwen2)
    tie_word_embeddings: bool
    num_deepstack: int  # Qwen3-VL: extra image rows added after the first layers
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int = 0  # the context the model was trained for (0 = unknown)

    @property
    def image_row_width(self) -> int:
        """Width of one received image row: main embedding plus its deepstack rows."""
        return self.hidden_size * (1 + self.num_deepstack)

    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> TextModelConfig:
        path = Path(model_path)
        raw = json.loads((path / "config.json").read_text())
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}")
        text = raw.get("text_config") or raw
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
            raise ValueError(f"unsupported rope type in {rope}")
        num_heads = text["num_attention_heads"]
        head_dim = text.get("head_dim") or text["hidden_size"] // num_heads
        qwen3 = model_type == "qwen3_vl"
        vision = raw.get("vision_config") or {}
        eos = set(_as_list(text.get("eos_token_id")) + _as_list(raw.get("eos_token_id")))
        gen_path = path / "generation_config.json"
        if gen_path.exists():
            eos |= set(_as_list(json.loads(gen_path.read_text()).get("eos_token_id")))
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return cls(
            model_type=model_type,
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_layers=text["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=text.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
            mrope_section=tuple(rope["mrope_section"]),
            mrope_interleaved=bool(rope.get("mrope_interleaved", qwen3)),
            qk_norm=qwen3,
            attention_bias=text.get("attention_bias", False) if qwen3 else True,
            tie_word_embeddings=bool(tie),
            num_deepstack=len(vision.get("deepstack_visual_indexes") or []) if qwen3 else 0,
            eos_token_ids=tuple(sorted(eos)),
            max_position_embeddings=int(text.get("max_position_embeddings") or 0),
        )


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]
