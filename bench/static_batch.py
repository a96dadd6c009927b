"""The fair monolithic peer for ``bench.e2e``: transformers ``generate`` over static batches.

A monolithic server without continuous batching still batches: it takes the next ``batch_size``
requests, pads their prompts to the longest on the left, runs the ViT over all their images and
one greedy ``generate`` for the whole batch, and answers every request of the batch when the
batch ends. ``collate`` builds such a batch from per-request ``ReferenceInputs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.models.hf_reference import HFReference, ReferenceInputs


@dataclass
class StaticBatch:
    """``generate``'s keyword arguments for one left-padded batch."""

    input_ids: torch.Tensor  # [B, L], pads on the left
    attention_mask: torch.Tensor  # [B, L], 0 at pads
    mm_token_type_ids: torch.Tensor  # [B, L], 1 at image tokens
    pixel_values: torch.Tensor | None  # every image's patches, request by request
    image_grid_thw: torch.Tensor | None

    def kwargs(self) -> dict:
        out = {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "mm_token_type_ids": self.mm_token_type_ids,
        }
        if self.pixel_values is not None:
            out.update(pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw)
        return out


def collate(inputs: list[ReferenceInputs], pad_id: int) -> StaticBatch:
    """Left-pad every prompt to the longest; images concatenated in request order."""
    length = max(i.input_ids.shape[1] for i in inputs)
    num = len(inputs)
    ids = torch.full((num, length), pad_id, dtype=torch.long)
    mask = torch.zeros((num, length), dtype=torch.long)
    mm = torch.zeros((num, length), dtype=torch.long)
    for row, one in enumerate(inputs):
        n = one.input_ids.shape[1]
        ids[row, length - n :] = one.input_ids[0]
        mask[row, length - n :] = 1
        mm[row, length - n :] = one.mm_token_type_ids[0]
    with_images = [i for i in inputs if i.pixel_values is not None]
    pixels = torch.cat([i.pixel_values for i in with_images]) if with_images else None
    grids = torch.cat([i.image_grid_thw for i in with_images]) if with_images else None
    return StaticBatch(ids, mask, mm, pixels, grids)


@torch.no_grad()
def generate_batch(ref: HFReference, inputs: list[ReferenceInputs], max_new_tokens: int):
    """Greedy continuations of a static batch; one list of new token ids per request (pads
    after an early EOS included, as the batch runs until its longest answer ends)."""
    pad_id = ref.tokenizer.pad_token_id
    if pad_id is None:
        pad_id = ref.config.text_config.eos_token_id
    batch = collate(inputs, pad_id)
    out = ref.model.generate(
        **{k: v.to(ref.device) for k, v in batch.kwargs().items()},
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return out[:, batch.input_ids.shape[1] :].tolist()
