"""Load only the text-decoder weights of a Qwen-VL checkpoint as it comes from the Hub.

Reads exactly the weight files the checkpoint names (``model.safetensors.index.json`` when it
has one; see ``common.models.checkpoint_files``), skips the vision tower's tensors without
touching their bytes, and copies each text tensor straight from the file's memory map into the
decoder's parameter, converting the dtype on the way (bf16 weights into an fp32 or bf16 model).
The decoder is allocated once, in its final dtype, and each tensor's file pages are given back as
soon as it is copied, so peak memory is the model plus one tensor as stored.

Key layouts: ``model.layers.*`` / ``model.embed_tokens`` / ``model.norm`` (Qwen2-VL and
Qwen2.5-VL on the Hub), ``model.language_model.*`` (Qwen3-VL, and what transformers 5 names
everything), ``language_model.model.*`` / ``language_model.*`` (older exports). ``lm_head.weight``
is loaded when the embeddings are untied and ignored when they are tied, as are checkpoint
entries the decoder has no parameter for (rotary caches of older exports).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from common.models.checkpoint_files import copy_into
from services.language.model.config import TextModelConfig
from services.language.model.qwen import QwenTextModel
from services.language.model.rope import MRotaryEmbedding

logger = logging.getLogger(__name__)

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
    """Build the decoder on ``device`` in ``dtype`` with the checkpoint's text weights.

    Raises ``FileNotFoundError`` for a missing weight file and ``ValueError`` for a weight
    whose shape differs from the config's or that the checkpoint lacks.
    """
    start = time.monotonic()
    config = TextModelConfig.from_pretrained(model_path)
    rope = MRotaryEmbedding(
        config.head_dim, config.rope_theta, config.mrope_section, config.mrope_interleaved, device
    )
    with torch.device("meta"):
        model = QwenTextModel(config, rope)
    model = model.to(dtype=dtype).to_empty(device=device)
    try:
        stats = copy_into(
            model.checkpoint_targets(), model_path, text_param_name, ignore_unknown=True
        )
    except ValueError as exc:
        raise ValueError(f"text weights: {exc}") from None
    logger.info(
        "loaded %d text weights (%.2f GB stored) into %s %s in %.1f s",
        stats.num_tensors, stats.nbytes / 1e9, device, dtype, time.monotonic() - start,
    )  # fmt: skip
    return model.eval()
