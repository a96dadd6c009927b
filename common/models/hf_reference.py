"""The monolithic baseline: transformers' own model, preprocessing and ``generate``.

Tests compare the disaggregated path's greedy tokens against this, and benchmarks use it as the
baseline. It deliberately shares no code with the encoder's preprocessing or the language
engine: it is the reference they are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image


@dataclass
class ReferenceInputs:
    """What ``generate`` takes for one request (batch of 1)."""

    input_ids: torch.Tensor  # [1, L], image pads expanded
    mm_token_type_ids: torch.Tensor  # [1, L], 1 at image tokens
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None


class HFReference:
    """Loads a checkpoint with transformers and runs it the monolithic way.

    ``dtype`` is the whole model's compute dtype. With ``wire_dtype``, the vision tower's output
    (embeddings and deepstack rows) is rounded to that dtype and back, exactly what the
    disaggregated path does to rows it ships in that wire dtype; everything else is unchanged.
    """

    def __init__(
        self,
        model_path: str | Path,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.image_processor = AutoImageProcessor.from_pretrained(str(model_path))
        self.model = (
            AutoModelForImageTextToText.from_pretrained(str(model_path), dtype=dtype)
            .to(device)
            .eval()
        )
        self.device = device
        self.config = self.model.config
        if wire_dtype is not None:
            self.model.model.visual.register_forward_hook(_rounding_hook(wire_dtype))

    def build_inputs(self, prompt: str, images: list[Image.Image]) -> ReferenceInputs:
        """Images first, then the text, in one user turn (the ``epd generate`` layout)."""
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
        return self.build_chat_inputs([{"role": "user", "content": content}], images)

    def build_chat_inputs(self, messages: list[dict], images: list[Image.Image]) -> ReferenceInputs:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        pixel_values = grid_thw = None
        if images:
            out = self.image_processor(
                images=[im.convert("RGB") for im in images], return_tensors="pt"
            )
            pixel_values, grid_thw = out["pixel_values"], out["image_grid_thw"]
            merge = self.image_processor.merge_size**2
            pieces = text.split("<|image_pad|>")
            assert len(pieces) == len(images) + 1, "one image placeholder per image"
            text = pieces[0]
            for thw, piece in zip(grid_thw, pieces[1:], strict=True):
                text += "<|image_pad|>" * (int(thw.prod()) // merge) + piece
        ids = self.tokenizer(text, return_tensors="pt").input_ids
        mm = (ids == self.config.image_token_id).long()
        return ReferenceInputs(ids, mm, pixel_values, grid_thw)

    @torch.no_grad()
    def generate(self, inputs: ReferenceInputs, max_new_tokens: int = 16) -> list[int]:
        """Greedy continuation token ids (EOS included when produced)."""
        kwargs = {}
        if inputs.pixel_values is not None:
            kwargs = {
                "pixel_values": inputs.pixel_values.to(self.device),
                "image_grid_thw": inputs.image_grid_thw.to(self.device),
            }
        ids = inputs.input_ids.to(self.device)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=inputs.mm_token_type_ids.to(self.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **kwargs,
        )
        return out[0, ids.shape[1] :].tolist()


def _rounding_hook(wire_dtype: torch.dtype):
    """A forward hook that rounds the vision tower's rows to ``wire_dtype`` and back."""

    def round_trip(rows: torch.Tensor) -> torch.Tensor:
        return rows.to(wire_dtype).to(rows.dtype)

    def hook(module, args, output):
        output.pooler_output = round_trip(output.pooler_output)
        deepstack = getattr(output, "deepstack_features", None)
        if deepstack:
            output.deepstack_features = [round_trip(rows) for rows in deepstack]
        return output

    return hook
