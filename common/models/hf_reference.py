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
    # a video (``hf_video_reference``): its patches, grid and seconds per frame group
    video: dict[str, torch.Tensor] | None = None

    def vision_kwargs(self, device: str) -> dict[str, torch.Tensor]:
        kwargs = {}
        if self.pixel_values is not None:
            kwargs["pixel_values"] = self.pixel_values.to(device)
            kwargs["image_grid_thw"] = self.image_grid_thw.to(device)
        for name, value in (self.video or {}).items():
            kwargs[name] = value.to(device)
        return kwargs


class HFReference:
    """Loads a checkpoint with transformers and runs it the monolithic way.

    ``dtype`` is the whole model's compute dtype. ``vision_dtype`` runs the vision tower in
    another one (a copy of it loaded in that dtype, as an encoder loads it). With ``wire_dtype``,
    the vision tower's output (embeddings and deepstack rows) is rounded to that dtype, exactly
    what the disaggregated path does to rows it ships in that wire dtype, then cast to ``dtype``
    for the text model; everything else is unchanged.
    """

    def __init__(
        self,
        model_path: str | Path,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        wire_dtype: torch.dtype | None = None,
        vision_dtype: torch.dtype | None = None,
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
        tower = None
        if vision_dtype is not None and vision_dtype != dtype:
            tower = (
                AutoModelForImageTextToText.from_pretrained(str(model_path), dtype=vision_dtype)
                .model.visual.to(device)
                .eval()
            )
        if tower is not None or wire_dtype is not None:
            self.model.model.visual.register_forward_hook(
                _vision_hook(tower, wire_dtype, dtype), with_kwargs=True
            )

    def build_inputs(self, prompt: str, images: list[Image.Image]) -> ReferenceInputs:
        """Images first, then the text, in one user turn (the ``epd generate`` layout)."""
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
        return self.build_chat_inputs([{"role": "user", "content": content}], images)

    def build_chat_inputs(self, messages: list[dict], images: list[Image.Image]) -> ReferenceInputs:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        text, pixel_values, grid_thw = self._with_images(text, images)
        ids = self.tokenizer(text, return_tensors="pt").input_ids
        mm = (ids == self.config.image_token_id).long()
        return ReferenceInputs(ids, mm, pixel_values, grid_thw)

    def _with_images(self, text: str, images: list[Image.Image]):
        """``text`` with each image placeholder repeated once per image token, and the
        images' ``pixel_values`` and ``image_grid_thw`` (None, None without images)."""
        if not images:
            return text, None, None
        out = self.image_processor(images=[im.convert("RGB") for im in images], return_tensors="pt")
        pixel_values, grid_thw = out["pixel_values"], out["image_grid_thw"]
        merge = self.image_processor.merge_size**2
        pieces = text.split("<|image_pad|>")
        assert len(pieces) == len(images) + 1, "one image placeholder per image"
        text = pieces[0]
        for thw, piece in zip(grid_thw, pieces[1:], strict=True):
            text += "<|image_pad|>" * (int(thw.prod()) // merge) + piece
        return text, pixel_values, grid_thw

    def build_video_inputs(
        self, messages: list[dict], images: list[Image.Image], video: bytes, spec
    ) -> ReferenceInputs:
        """``messages`` with one ``{"type": "video"}`` part (the encoded ``video``, sampled by
        ``spec``, a ``hf_video_reference.VideoSpec``) and its image parts (``images``)."""
        from common.models.hf_video_reference import (
            expand_video_text,
            mm_token_types,
            reference_video,
        )

        ref = reference_video(video, self.image_processor, spec)
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        text = expand_video_text(
            text,
            ref,
            self.image_processor.merge_size,
            timestamps=self.config.model_type == "qwen3_vl",
        )
        text, pixel_values, grid_thw = self._with_images(text, images)
        ids = self.tokenizer(text, return_tensors="pt").input_ids
        video_kwargs = {
            "pixel_values_videos": ref.pixel_values_videos,
            "video_grid_thw": ref.video_grid_thw,
        }
        if self.config.model_type == "qwen2_5_vl":
            video_kwargs["second_per_grid_ts"] = torch.tensor([ref.second_per_grid_t])
        mm = mm_token_types(ids, self.config)
        return ReferenceInputs(ids, mm, pixel_values, grid_thw, video_kwargs)

    @torch.no_grad()
    def next_token_logprobs(self, inputs: ReferenceInputs) -> torch.Tensor:
        """Log-probabilities (float32, [vocab]) of the token after the prompt."""
        ids = inputs.input_ids.to(self.device)
        kwargs = inputs.vision_kwargs(self.device)
        out = self.model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=inputs.mm_token_type_ids.to(self.device),
            **kwargs,
        )
        return torch.log_softmax(out.logits[0, -1].float(), dim=-1).cpu()

    def generate(self, inputs: ReferenceInputs, max_new_tokens: int = 16) -> list[int]:
        """Greedy continuation token ids (EOS included when produced)."""
        return self._generate(inputs, max_new_tokens, scored=False)[0]

    def generate_scored(
        self, inputs: ReferenceInputs, max_new_tokens: int = 16
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy continuation token ids and each step's log-probabilities (float32, [vocab],
        on the CPU)."""
        return self._generate(inputs, max_new_tokens, scored=True)

    @torch.no_grad()
    def _generate(self, inputs: ReferenceInputs, max_new_tokens: int, scored: bool):
        kwargs = inputs.vision_kwargs(self.device)
        ids = inputs.input_ids.to(self.device)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=inputs.mm_token_type_ids.to(self.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=scored,
            return_dict_in_generate=True,
            **kwargs,
        )
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        if not scored:
            return tokens, []
        return tokens, [torch.log_softmax(s[0].float(), dim=-1).cpu() for s in out.scores]


def _vision_hook(tower, wire_dtype: torch.dtype | None, dtype: torch.dtype):
    """A forward hook on the model's vision tower: its rows come from ``tower`` (another dtype)
    when given, and go through ``wire_dtype`` when given, then back to ``dtype``."""

    def ship(rows: torch.Tensor) -> torch.Tensor:
        return rows.to(wire_dtype or rows.dtype).to(dtype)

    def hook(module, args, kwargs, output):
        if tower is not None:
            pixel_values = args[0].to(tower.dtype)
            output = tower(pixel_values, *args[1:], **kwargs)
        output.pooler_output = ship(output.pooler_output)
        deepstack = getattr(output, "deepstack_features", None)
        if deepstack:
            output.deepstack_features = [ship(rows) for rows in deepstack]
        return output

    return hook
