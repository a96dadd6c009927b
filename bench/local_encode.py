"""A stand-in encoder for tests and benchmarks: ``PromptInputs`` from transformers' own model.

It plays the encoder's part in-process: image tokens get a pad id from a hash of the image's
pixel values (the prompt carries each image's hash and token count), positions come from
``get_rope_index`` and image rows from ``model.model.visual`` (Qwen3-VL: main row then each
deepstack row, along the hidden dim).
"""

from __future__ import annotations

import hashlib

import torch

from common.models.hf_reference import HFReference, ReferenceInputs
from common.multimodal import pad_id_for
from services.language.image_identity import ImageRef
from services.language.inputs import PromptInputs


@torch.no_grad()
def local_encode(ref: HFReference, inputs: ReferenceInputs) -> PromptInputs:
    """What the encoder would ship for ``inputs``, as the engine's ``PromptInputs``."""
    ids = inputs.input_ids
    vocab = ref.config.text_config.vocab_size
    fill_ids = ids[0].clone()
    if inputs.pixel_values is None:
        positions = torch.arange(ids.shape[1]).expand(3, -1)
        return PromptInputs(fill_ids, positions, torch.zeros(0, 1), 0, images=())
    model = ref.model.model
    pos, delta = model.get_rope_index(
        ids,
        inputs.mm_token_type_ids,
        image_grid_thw=inputs.image_grid_thw,
        attention_mask=torch.ones_like(ids),
    )
    device = ref.model.device  # the rows arrive on the CPU, as they do off the wire
    out = model.visual(inputs.pixel_values.to(device), grid_thw=inputs.image_grid_thw.to(device))
    parts = [out.pooler_output] + list(getattr(out, "deepstack_features", None) or [])
    rows = torch.cat(parts, dim=-1).cpu()
    merge = ref.image_processor.merge_size**2
    image_positions = torch.nonzero(ids[0] == ref.config.image_token_id).flatten()
    patch_start = token_start = 0
    images = []
    for thw in inputs.image_grid_thw:
        num_patches = int(thw.prod())
        pixels = inputs.pixel_values[patch_start : patch_start + num_patches]
        digest = hashlib.sha256(pixels.numpy().tobytes()).digest()
        num_tokens = num_patches // merge
        run = image_positions[token_start : token_start + num_tokens]
        fill_ids[run] = pad_id_for(digest, vocab)
        images.append(ImageRef(digest[:8], num_tokens))
        patch_start, token_start = patch_start + num_patches, token_start + num_tokens
    delta_value = int(delta.flatten()[0])
    return PromptInputs(fill_ids, pos[:, 0], rows, delta_value, len(parts) - 1, tuple(images))
