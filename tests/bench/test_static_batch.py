"""The static-batch baseline of ``bench.e2e`` answers what one-by-one ``generate`` answers."""

from __future__ import annotations

import numpy as np
from PIL import Image

from bench.static_batch import collate, generate_batch
from common.models.hf_reference import HFReference


def test_collate_pads_left() -> None:
    import torch

    from common.models.hf_reference import ReferenceInputs

    short = ReferenceInputs(torch.tensor([[5, 6]]), torch.tensor([[0, 1]]), None, None)
    long = ReferenceInputs(torch.tensor([[7, 8, 9]]), torch.tensor([[0, 0, 1]]), None, None)
    batch = collate([short, long], pad_id=0)
    assert batch.input_ids.tolist() == [[0, 5, 6], [7, 8, 9]]
    assert batch.attention_mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert batch.mm_token_type_ids.tolist() == [[0, 0, 1], [0, 0, 1]]
    assert batch.pixel_values is None


def test_batch_matches_one_by_one(tiny_model_dir) -> None:
    ref = HFReference(tiny_model_dir("qwen2_5_vl"))
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8))
    inputs = [
        ref.build_inputs("a short one", []),
        ref.build_inputs("one image, and a longer prompt than the others", [image]),
        ref.build_inputs("two images", [image, image]),
    ]
    batched = generate_batch(ref, inputs, 6)
    for one, tokens in zip(inputs, batched, strict=True):
        alone = ref.generate(one, 6)
        assert tokens[: len(alone)] == alone
