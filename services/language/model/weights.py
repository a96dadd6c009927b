"""Load only the text-decoder weights of a Qwen-VL checkpoint's safetensors files."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from services.language.model.config import TextModelConfig
from services.language.model.qwen import QwenTextModel
from services.language.model.rope import MRotaryEmbedding

# Checkpoint layouts seen in the wild, longest first; vision weights are never read.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


def text_param_name(key: str) -> str | None:
    """The model parameter a checkpoint key maps to, or None for non-text weights."""
    if "visual" in key:
        return None
    if key.startswith("lm_head.") or key.startswith("language_model.lm_head."):
        return "lm_head." + key.rsplit("lm_head.", 1)[1]
    for prefix in _TEXT_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return None


def load_text_model(
    model_path: str | Path, device: torch.device, dtype: torch.dtype
) -> QwenTextModel:
    """Build the decoder on ``device`` in ``dtype`` with the checkpoint's text weights."""
    config = TextModelConfig.from_pretrained(model_path)
    rope = MRotaryEmbedding(
        config.head_dim, config.rope_theta, config.mrope_section, config.mrope_interleaved, device
    )
    with torch.device("meta"):
        model = QwenTextModel(config, rope)
    model = model.to_empty(device=device)
    expected = dict(model.named_parameters())
    loaded: set[str] = set()
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files under {model_path}")
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    name = text_param_name(key)
                    if name is None or name not in expected:
                        continue
                    expected[name].copy_(handle.get_tensor(key).to(dtype))
                    loaded.add(name)
    missing = sorted(set(expected) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_path} lacks text weights: {missing[:5]}")
    return model.to(dtype).eval()
