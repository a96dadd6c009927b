"""The Hub-layout builder: real shapes, configs both loaders read alike, deterministic shards."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from common.models.checkpoint_files import WEIGHTS_INDEX, checkpoint_shards, iter_tensors
from common.models.hf_reference import HFReference
from common.models.hub_checkpoint import QK_NORM_WEIGHT, tensor_plan, write_hub_checkpoint
from common.models.hub_config import HUB_SPECS, generation_config, hub_config, with_depth
from common.models.shard_writer import TensorSpec, write_shards
from services.language.model.config import TextModelConfig
from tests.conftest import ARCHS
from tests.models.conftest import small_spec

# Parameter counts of the published checkpoints (tied embeddings counted once).
PUBLISHED_PARAMS = {
    "qwen2_vl": 2_208_985_600,
    "qwen2_5_vl": 3_754_622_976,
    "qwen3_vl": 2_127_532_032,
}


@pytest.mark.parametrize("arch", ARCHS)
def test_real_specs_have_the_published_shapes(arch) -> None:
    plan = tensor_plan(hub_config(HUB_SPECS[arch]), torch.bfloat16)
    assert sum(t.numel for t, _ in plan) == PUBLISHED_PARAMS[arch]
    keys = {t.key for t, _ in plan}
    assert "lm_head.weight" not in keys  # the 2B/3B sizes tie their embeddings
    embed = (
        "model.language_model.embed_tokens.weight"
        if arch == "qwen3_vl"
        else ("model.embed_tokens.weight")
    )
    shapes = {t.key: t.shape for t, _ in plan}
    assert shapes[embed] == (151936, HUB_SPECS[arch].hidden_size)


@pytest.mark.parametrize("arch", ARCHS)
def test_real_config_reads_the_same_in_both_loaders(arch, tmp_path) -> None:
    """The language worker's config reader and transformers agree on the Hub config.json."""
    from transformers import AutoConfig

    spec = HUB_SPECS[arch]
    (tmp_path / "config.json").write_text(json.dumps(hub_config(spec)))
    (tmp_path / "generation_config.json").write_text(json.dumps(generation_config()))
    ours = TextModelConfig.from_pretrained(tmp_path)
    theirs = AutoConfig.from_pretrained(str(tmp_path))
    text = theirs.text_config
    assert (ours.hidden_size, ours.intermediate_size, ours.num_layers) == (
        text.hidden_size, text.intermediate_size, text.num_hidden_layers,
    )  # fmt: skip
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        spec.num_heads, spec.num_kv_heads, spec.head_dim,
    )  # fmt: skip
    assert ours.mrope_section == spec.mrope_section == tuple(text.rope_parameters["mrope_section"])
    assert ours.rope_theta == spec.rope_theta == text.rope_parameters["rope_theta"]
    assert ours.tie_word_embeddings and theirs.tie_word_embeddings
    assert ours.vocab_size == text.vocab_size == 151936
    assert ours.num_deepstack == spec.num_deepstack
    assert ours.eos_token_ids == (151643, 151645)


def test_with_depth_keeps_widths_and_scales_layer_indexes() -> None:
    qwen3 = with_depth(HUB_SPECS["qwen3_vl"], 4, 4)
    assert qwen3.deepstack_indexes == (0, 1, 2) and qwen3.hidden_size == 2048
    assert with_depth(HUB_SPECS["qwen2_5_vl"], 4, 4).fullatt_indexes == (3,)
    assert with_depth(HUB_SPECS["qwen2_5_vl"], 4, 16).fullatt_indexes == (7, 15)
    with pytest.raises(ValueError, match="cannot hold 3 taps"):
        with_depth(HUB_SPECS["qwen3_vl"], 4, 2)


def _tensors(path) -> dict[str, torch.Tensor]:
    return {key: t.clone() for _, key, t in iter_tensors(path, lambda key: key)}


def test_weights_do_not_depend_on_sharding(tmp_path) -> None:
    spec = small_spec("qwen3_vl", tied=False)
    sharded = write_hub_checkpoint(tmp_path / "a", spec, tokenizer="test", max_shard_bytes=50_000)
    single = write_hub_checkpoint(tmp_path / "b", spec, tokenizer="test", max_shard_bytes=1 << 30)
    assert len(checkpoint_shards(sharded)) > 5 and (sharded / WEIGHTS_INDEX).exists()
    assert list(checkpoint_shards(single)) == [single / "model.safetensors"]
    assert not (single / WEIGHTS_INDEX).exists()
    a, b = _tensors(sharded), _tensors(single)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the safetensors library reads the streamed files the same way
    with safe_open(str(single / "model.safetensors"), framework="pt") as handle:
        assert all(torch.equal(handle.get_tensor(k), b[k]) for k in handle.keys())
    index = json.loads((sharded / WEIGHTS_INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in a.values())
    norms = {k: v for k, v in a.items() if k.endswith("norm.weight")}
    qk = {k for k in norms if k.endswith(("q_norm.weight", "k_norm.weight"))}
    assert qk and all(torch.all(norms[k] == QK_NORM_WEIGHT) for k in qk)
    assert all(torch.all(v == 1) for k, v in norms.items() if k not in qk)


def test_write_shards_checks_what_it_is_given(tmp_path) -> None:
    spec = TensorSpec("w", (4, 4), torch.bfloat16)
    with pytest.raises(ValueError, match="w: fill gave 16 bytes, expected 32"):
        write_shards(tmp_path, [spec], lambda s: [torch.zeros(8, dtype=s.dtype)], 1 << 20)
    with pytest.raises(TypeError, match="float32"):
        write_shards(tmp_path, [spec], lambda s: [torch.zeros(16)], 1 << 20)
    with pytest.raises(ValueError, match="duplicate"):
        write_shards(tmp_path, [spec, spec], lambda s: [torch.zeros(16, dtype=s.dtype)], 1 << 20)


def _noise(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (84, 112, 3), dtype=np.uint8))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_depends_on_prompt_and_image(arch, hub_checkpoint) -> None:
    ref = HFReference(hub_checkpoint(arch, True))
    outs = {
        (prompt, seed): tuple(ref.generate(ref.build_inputs(prompt, [_noise(seed)]), 8))
        for prompt in ("Describe the image.", "What is this?")
        for seed in (0, 1)
    }
    assert all(len(set(o)) > 1 for o in outs.values())
    assert outs[("Describe the image.", 0)] != outs[("Describe the image.", 1)]
    assert outs[("Describe the image.", 0)] != outs[("What is this?", 0)]
