"""Random-weight checkpoints with real shapes and the Hub's file layout, built shard by shard.

``write_hub_checkpoint(out, spec)`` writes what a Qwen-VL repository holds: ``config.json`` in
the repository's layout (``hub_config``), ``generation_config.json``,
``preprocessor_config.json``, a tokenizer with the VL chat template, and bf16 safetensors shards
with ``model.safetensors.index.json`` under the Hub's key names:

* Qwen2-VL / Qwen2.5-VL: ``model.layers.*``, ``model.embed_tokens``, ``model.norm``,
  ``visual.*``, ``lm_head.weight``;
* Qwen3-VL: ``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``;

``lm_head.weight`` only when the embeddings are untied (the 2B/3B sizes tie them).

The tensor list comes from transformers' own model built on the meta device, so names and
shapes are the real ones; no tensor is materialised until it is written, one chunk at a time.

Weights are seeded per tensor (from the seed and the tensor's key), so a checkpoint does not
depend on shard size or write order. Linear and convolution weights are drawn with std
``GAIN / sqrt(fan_in)`` (the per-layer gain that ``tiny.INIT_STD`` gives the test size),
embeddings with ``EMBED_STD``, norms are 1 (bias 0): activations stay O(1) per layer at any
width, so outputs are finite in bf16 and greedy continuations depend on the prompt and image.
Qwen3's per-head q/k norms are ``QK_NORM_WEIGHT``: with norms of 1 its attention scores have
std 1 whatever the width, attention averages over the whole prompt, and the continuation stops
depending on the image (the test checks this).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import xxhash

from common.models.hub_config import (
    HubSpec,
    generation_config,
    hub_config,
    preprocessor_config,
)
from common.models.shard_writer import TensorSpec, chunked_rows, write_shards
from common.models.tokenizers import build_qwen2_tokenizer, build_test_tokenizer, special_token_ids

# Bump when the generated checkpoints change, so cached copies are rebuilt.
HUB_RECIPE_VERSION = 2  # 2: the chat template renders video parts
SEED = 1234
GAIN = 1.7
EMBED_STD = 0.15
BIAS_STD = 0.05
QK_NORM_WEIGHT = 2.0
CHUNK_NUMEL = 1 << 24  # 64 MiB of fp32 noise at a time
DEFAULT_SHARD_BYTES = 1_500_000_000
TOKENIZERS = ("qwen2", "test")

# Hub key prefixes of the legacy Qwen2/2.5-VL layout, by transformers' module prefix.
_LEGACY_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def hub_key(arch: str, name: str) -> str:
    """The Hub checkpoint key of transformers' parameter ``name``."""
    if arch != "qwen3_vl":
        for ours, theirs in _LEGACY_PREFIXES:
            if name.startswith(ours):
                return theirs + name[len(ours) :]
    return name


def _meta_model(config_dict: dict):
    import transformers

    from common.models.hub_config import ARCHITECTURES

    model_cls = getattr(transformers, ARCHITECTURES[config_dict["model_type"]])
    # NOTE: from_dict rewrites nested dicts (rope_scaling) in place; keep the caller's intact.
    config = model_cls.config_class.from_dict(copy.deepcopy(config_dict))
    with torch.device("meta"):
        return model_cls(config)


@dataclass(frozen=True)
class Init:
    """How one tensor is filled: ``value`` everywhere, or normal noise of std ``std``."""

    std: float = 0.0
    value: float = 0.0


def init_for(module_name: str, module: torch.nn.Module, param_name: str, param) -> Init:
    """The fill of one parameter (see the module docstring)."""
    if module_name.endswith(("q_norm", "k_norm")):
        return Init(value=QK_NORM_WEIGHT)
    if "Norm" in type(module).__name__:
        return Init(value=1.0 if param_name == "weight" else 0.0)
    if isinstance(module, torch.nn.Embedding):
        return Init(std=EMBED_STD)
    if param_name == "bias":
        return Init(std=BIAS_STD)
    return Init(std=GAIN / math.sqrt(param[0].numel()))


def tensor_plan(config_dict: dict, dtype: torch.dtype) -> list[tuple[TensorSpec, Init]]:
    """Every tensor of the checkpoint with its fill: text first, then the vision tower (as the
    Hub's shards are ordered), each in module order."""
    arch = config_dict["model_type"]
    model = _meta_model(config_dict)
    tied = model.config.tie_word_embeddings
    plan = []
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if tied and name == "lm_head.weight":
                continue
            spec = TensorSpec(hub_key(arch, name), tuple(param.shape), dtype)
            plan.append((spec, init_for(module_name, module, param_name, param)))
    return sorted(plan, key=lambda item: "visual." in item[0].key)


def _seed(seed: int, key: str) -> int:
    return xxhash.xxh64_intdigest(f"{seed}/{key}".encode()) & ((1 << 63) - 1)


def _filler(inits: dict[str, Init], seed: int):
    def fill(spec: TensorSpec):
        init = inits[spec.key]
        generator = torch.Generator().manual_seed(_seed(seed, spec.key))
        row_numel = spec.numel // spec.shape[0] if spec.shape else 1
        for _, rows in chunked_rows(spec, CHUNK_NUMEL):
            shape = (rows * row_numel,)
            if init.std == 0.0:
                yield torch.full(shape, init.value, dtype=spec.dtype)
            else:
                noise = torch.randn(shape, generator=generator)
                yield noise.mul_(init.std).to(spec.dtype)

    return fill


def write_hub_checkpoint(
    out: str | Path,
    spec: HubSpec,
    *,
    tokenizer: str = "qwen2",
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    seed: int = SEED,
) -> Path:
    """Write the checkpoint of ``spec`` to ``out`` and return it.

    ``tokenizer``: ``qwen2`` (the real one; the spec's vocabulary must hold it) or ``test`` (the
    tiny BPE; the vocabulary becomes its size). ``dtype``: of the stored weights.
    """
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; expected one of {TOKENIZERS}")
    tok = build_qwen2_tokenizer() if tokenizer == "qwen2" else build_test_tokenizer()
    ids = special_token_ids(tok)
    if tokenizer == "test":
        spec = replace(spec, vocab_size=len(tok))
    elif len(tok) > spec.vocab_size:
        raise ValueError(f"{spec.name}: vocabulary {spec.vocab_size} < tokenizer's {len(tok)}")
    config = hub_config(spec, ids)
    plan = tensor_plan(config, dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    inits = {tensor.key: init for tensor, init in plan}
    write_shards(out, [tensor for tensor, _ in plan], _filler(inits, seed), max_shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = generation_config(ids, tok.pad_token_id)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    preprocessor = preprocessor_config(spec.arch)
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    tok.save_pretrained(out)
    return out


def weight_bytes(path: str | Path) -> dict[str, int]:
    """Bytes of the checkpoint's stored weights: ``text``, ``visual`` and ``total``."""
    from common.models.checkpoint_files import checkpoint_shards, read_header

    sizes = {"text": 0, "visual": 0}
    for file, keys in checkpoint_shards(path).items():
        entries = read_header(file)
        for key in keys:
            sizes["visual" if "visual." in key else "text"] += entries[key].nbytes
    return {**sizes, "total": sizes["text"] + sizes["visual"]}
