"""The language and encoder loaders read Hub-layout checkpoints exactly as transformers does.

Each checkpoint is bf16, sharded with an index, in the Hub's key names and config layout, tied
or untied; the loaders' tensors must equal transformers' own ``from_pretrained`` of the same
directory, and every broken checkpoint must fail with an error that names the problem.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from common.models.checkpoint_files import WEIGHTS_INDEX, checkpoint_shards
from services.encoder.checkpoint import load_checkpoint
from services.encoder.vision import VisionTower, read_visual_state_dict
from services.language.model.weights import load_text_model
from tests.conftest import ARCHS

CPU = torch.device("cpu")
CASES = [(arch, tied) for arch in ARCHS for tied in (True, False)]


def hf_model(path, dtype=torch.float32):
    from transformers import AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(
        str(path), dtype=dtype, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model


def assert_text_equal(ours, hf) -> None:
    theirs = hf.model.language_model.state_dict()
    targets = ours.checkpoint_targets()  # q / k / v and gate / up: views of the fused layers
    mine = {k: v for k, v in targets.items() if not k.startswith("lm_head.")}
    assert mine.keys() == theirs.keys()
    for key, value in mine.items():
        assert value.dtype == theirs[key].dtype, key
        assert torch.equal(value, theirs[key]), key
    head = ours.embed_tokens.weight if ours.lm_head is None else ours.lm_head.weight
    assert torch.equal(head, hf.lm_head.weight)


@pytest.mark.parametrize(("arch", "tied"), CASES)
def test_layout_is_the_hubs(arch, tied, hub_checkpoint) -> None:
    path = hub_checkpoint(arch, tied)
    config = json.loads((path / "config.json").read_text())
    keys = [k for keys in checkpoint_shards(path).values() for k in keys]
    assert len(checkpoint_shards(path)) > 2 and (path / WEIGHTS_INDEX).exists()
    assert ("lm_head.weight" in keys) is not tied
    if arch == "qwen3_vl":
        assert "text_config" in config and "hidden_size" not in config
        prefixes = ("model.language_model.", "model.visual.", "lm_head.")
        assert all(k.startswith(prefixes) for k in keys)
    else:  # legacy flat config and keys
        assert "text_config" not in config and config["hidden_size"] == 128
        assert config["rope_scaling"] == {"type": "mrope", "mrope_section": [4, 6, 6]}
        assert all(k.startswith(("model.layers.", "model.embed_tokens", "model.norm", "visual.",
                                 "lm_head.")) for k in keys)  # fmt: skip


@pytest.mark.parametrize(("arch", "tied"), CASES)
def test_text_weights_equal_transformers_load(arch, tied, hub_checkpoint) -> None:
    path = hub_checkpoint(arch, tied)
    hf = hf_model(path)
    ours = load_text_model(path, CPU, torch.float32)
    assert (ours.lm_head is None) is tied
    assert_text_equal(ours, hf)
    # the stored weights are bf16: fp32 holds them exactly, and they are not all zeros/ones
    weight = ours.checkpoint_targets()["layers.0.mlp.up_proj.weight"]
    assert torch.equal(weight, weight.to(torch.bfloat16).float()) and weight.std() > 0.05


@pytest.mark.parametrize("arch", ARCHS)
def test_text_weights_into_bf16(arch, hub_checkpoint) -> None:
    path = hub_checkpoint(arch, False)
    ours = load_text_model(path, CPU, torch.bfloat16)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    assert_text_equal(ours, hf_model(path, torch.bfloat16))


@pytest.mark.parametrize(("arch", "tied"), CASES)
def test_vision_weights_equal_transformers_load(arch, tied, hub_checkpoint) -> None:
    path = hub_checkpoint(arch, tied)
    hf_visual = hf_model(path).model.visual.state_dict()
    state = read_visual_state_dict(path)
    assert state.keys() == hf_visual.keys()
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    assert all(torch.equal(v.float(), hf_visual[k]) for k, v in state.items())
    # the weights as loaded: prepacked linears (auto on a CPU) keep theirs outside the state dict
    tower = VisionTower(load_checkpoint(path), device="cpu", dtype="float32", linear_kernel="plain")
    mine = tower.module.state_dict()
    assert mine.keys() == hf_visual.keys()
    assert all(torch.equal(v, hf_visual[k]) for k, v in mine.items())


@pytest.fixture
def copy_of(hub_checkpoint, tmp_path):
    def copy(arch: str, tied: bool = False):
        return shutil.copytree(hub_checkpoint(arch, tied), tmp_path / arch)

    return copy


def test_only_the_files_the_index_names_are_read(copy_of) -> None:
    path = copy_of("qwen2_5_vl")
    hf = hf_model(path)
    visual = read_visual_state_dict(path)
    # stray files beside the shards: garbage, and an older export holding other values
    (path / "consolidated.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    save_file({"model.norm.weight": torch.zeros(128), "visual.merger.ln_q.weight": torch.zeros(64)},
              str(path / "model-00001-of-00002.safetensors"))  # fmt: skip
    assert_text_equal(load_text_model(path, CPU, torch.float32), hf)
    again = read_visual_state_dict(path)
    assert again.keys() == visual.keys()
    assert all(torch.equal(again[k], v) for k, v in visual.items())


def test_missing_shard_is_an_error_naming_it(copy_of) -> None:
    path = copy_of("qwen3_vl")
    index = json.loads((path / WEIGHTS_INDEX).read_text())
    text_shard = index["weight_map"]["model.language_model.norm.weight"]
    (path / text_shard).unlink()
    with pytest.raises(FileNotFoundError, match=text_shard):
        load_text_model(path, CPU, torch.float32)
    with pytest.raises(FileNotFoundError, match=text_shard):
        read_visual_state_dict(path)


def test_index_key_absent_from_its_shard(copy_of) -> None:
    path = copy_of("qwen2_vl")
    index = json.loads((path / WEIGHTS_INDEX).read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = index["weight_map"][
        "model.norm.weight"
    ]
    (path / WEIGHTS_INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model\.layers\.9\.mlp\.up_proj\.weight"):
        load_text_model(path, CPU, torch.float32)


def test_untied_checkpoint_without_lm_head(copy_of) -> None:
    path = copy_of("qwen2_vl")
    index = json.loads((path / WEIGHTS_INDEX).read_text())
    del index["weight_map"]["lm_head.weight"]
    (path / WEIGHTS_INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"text weights: .* lacks \['lm_head.weight'\]"):
        load_text_model(path, CPU, torch.float32)


def test_shape_that_disagrees_with_the_config(copy_of) -> None:
    path = copy_of("qwen2_5_vl")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 320
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mlp\..*_proj\.weight has shape .* implies"):
        load_text_model(path, CPU, torch.float32)


def test_checkpoint_without_weights(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        checkpoint_shards(tmp_path)
    (tmp_path / WEIGHTS_INDEX).write_text("[]")
    with pytest.raises(ValueError, match="not a safetensors index"):
        checkpoint_shards(tmp_path)
