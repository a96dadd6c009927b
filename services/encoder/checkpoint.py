"""What the encoder reads from a checkpoint directory besides the vision weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

# model_type -> (transformers modeling module, model class with get_rope_index, vision tower)
ARCH_CLASSES = {
    "qwen2_vl": (
        "qwen2_vl.modeling_qwen2_vl",
        "Qwen2VLModel",
        "Qwen2VisionTransformerPretrainedModel",
    ),
    "qwen2_5_vl": (
        "qwen2_5_vl.modeling_qwen2_5_vl",
        "Qwen2_5_VLModel",
        "Qwen2_5_VisionTransformerPretrainedModel",
    ),
    "qwen3_vl": ("qwen3_vl.modeling_qwen3_vl", "Qwen3VLModel", "Qwen3VLVisionModel"),
}
MODEL_CLASS, VISION_CLASS = 1, 2


@dataclass(frozen=True)
class Checkpoint:
    """Config, tokenizer and image processor of one Qwen-VL checkpoint (no weights)."""

    path: Path
    config: Any  # the transformers Qwen*VLConfig
    tokenizer: Any
    image_processor: Any  # Qwen2VLImageProcessorPil
    revision: str  # changes when the config or the weight files change

    @property
    def arch(self) -> str:
        return self.config.model_type

    @property
    def vocab_size(self) -> int:
        return int(self.config.text_config.vocab_size)

    @property
    def image_token_id(self) -> int:
        return int(self.config.image_token_id)

    @property
    def video_token_id(self) -> int:
        return int(self.config.video_token_id)

    @property
    def merge_size(self) -> int:
        return int(self.config.vision_config.spatial_merge_size)

    @property
    def video_timestamps_in_prompt(self) -> bool:
        """Qwen3-VL writes each frame group's time into the prompt (``<t seconds>``)."""
        return self.arch == "qwen3_vl"

    @property
    def hidden_size(self) -> int:
        """Width of one merged image embedding (= the language model's hidden size)."""
        vision = self.config.vision_config
        return int(getattr(vision, "out_hidden_size", None) or vision.hidden_size)

    @property
    def num_deepstack(self) -> int:
        return len(getattr(self.config.vision_config, "deepstack_visual_indexes", None) or ())

    @property
    def row_width(self) -> int:
        return self.hidden_size * (1 + self.num_deepstack)

    def model_class(self, which: int) -> type:
        """``MODEL_CLASS`` or ``VISION_CLASS`` of this architecture."""
        import importlib

        module = importlib.import_module("transformers.models." + ARCH_CLASSES[self.arch][0])
        return getattr(module, ARCH_CLASSES[self.arch][which])


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read the config, tokenizer and image processor of ``path`` (no model weights)."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path))
    if config.model_type not in ARCH_CLASSES:
        raise ValueError(
            f"unsupported model type {config.model_type!r}; expected one of {list(ARCH_CLASSES)}"
        )
    return Checkpoint(
        path=path,
        config=config,
        tokenizer=AutoTokenizer.from_pretrained(str(path)),
        image_processor=AutoImageProcessor.from_pretrained(str(path)),
        revision=checkpoint_revision(path),
    )


def checkpoint_revision(path: Path) -> str:
    """A cheap fingerprint: config.json bytes + name, size and mtime of every weight file.

    NOTE: weights rewritten in place with the same size within one mtime tick go unnoticed.
    """
    h = xxhash.xxh3_64()
    h.update((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        st = weights.stat()
        h.update(json.dumps([weights.name, st.st_size, st.st_mtime_ns]).encode())
    return h.hexdigest()
