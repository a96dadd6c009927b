"""Generated checkpoints load through from_pretrained and make discriminating references."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from common.models.hf_reference import HFReference
from common.models.tiny import make_tiny_model
from tests.conftest import ARCHS


def noise_image(seed: int, side: int = 112) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_depends_on_prompt_and_image(arch: str, tiny_model_dir) -> None:
    ref = HFReference(tiny_model_dir(arch))
    outs = {
        (prompt, seed): tuple(ref.generate(ref.build_inputs(prompt, [noise_image(seed)]), 8))
        for prompt in ("Describe the image.", "What is this?")
        for seed in (0, 1)
    }
    text_only = [tuple(ref.generate(ref.build_inputs(p, []), 8)) for p in ("Hello", "The fox")]
    # every output has some variety: not one token repeated
    assert all(len(set(o)) > 1 for o in [*outs.values(), *text_only])
    # changing only the image, or only the prompt, changes the continuation
    assert outs[("Describe the image.", 0)] != outs[("Describe the image.", 1)]
    assert outs[("Describe the image.", 0)] != outs[("What is this?", 0)]
    assert text_only[0] != text_only[1]


def test_checkpoint_is_deterministic(tmp_path, tiny_model_dir) -> None:
    from safetensors.numpy import load_file

    again = make_tiny_model("qwen2_vl", tmp_path / "again", "test")
    a = load_file(str(tiny_model_dir("qwen2_vl") / "model.safetensors"))
    b = load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert (again / "preprocessor_config.json").exists()
    assert (
        "chat_template" in (again / "tokenizer_config.json").read_text()
        or (again / "chat_template.jinja").exists()
    )
