"""Chat messages + prepared images -> fill ids and M-RoPE positions (``Prompt``).

The template renders each image as ``<|vision_start|><|image_pad|><|vision_end|>``. We tokenize
the rendered text once, then expand every ``<|image_pad|>`` id to the image's token count (the
pad is a special token, so this equals tokenizing the expanded text), compute positions with
``image_token_id`` at image tokens, and only then replace each image's ids by its pad id.
"""

from __future__ import annotations

import numpy as np

from common.multimodal import pad_id_for

from .checkpoint import Checkpoint
from .errors import InvalidInput
from .rope import RopeIndexer
from .types import ChatMessage, PreparedImage, Prompt

RESERVED_TEXT = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def template_messages(messages: tuple[ChatMessage, ...] | list[ChatMessage]) -> list[dict]:
    """Domain messages -> the dicts the chat template takes (images as ``{"type": "image"}``)."""
    out = []
    for message in messages:
        parts = []
        for part in message.content:
            if part.image is not None:
                parts.append({"type": "image"})
            else:
                text = part.text or ""
                for token in RESERVED_TEXT:
                    if token in text:
                        raise InvalidInput(f"text contains the reserved token {token}")
                parts.append({"type": "text", "text": text})
        out.append({"role": message.role, "content": parts})
    return out


class PromptBuilder:
    def __init__(self, checkpoint: Checkpoint) -> None:
        self._tokenizer = checkpoint.tokenizer
        self._image_token_id = checkpoint.image_token_id
        self._vocab_size = checkpoint.vocab_size
        self._rope = RopeIndexer(checkpoint)

    def text_ids(self, messages: list[dict]) -> np.ndarray:
        """Token ids of the rendered template, one ``image_token_id`` per image."""
        text = self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return np.asarray(self._tokenizer(text)["input_ids"], dtype=np.int64)

    def check_length(self, ids: np.ndarray, image_tokens: list[int], limit: int) -> int:
        """The prompt's length once each image placeholder of ``ids`` is expanded to its
        ``image_tokens``; ``InvalidInput`` when it exceeds ``limit``."""
        num_images = int((ids == self._image_token_id).sum())
        if num_images != len(image_tokens):
            raise InvalidInput(
                f"the chat template rendered {num_images} image placeholders for "
                f"{len(image_tokens)} images"
            )
        num_text, num_image = len(ids) - num_images, sum(image_tokens)
        total = num_text + num_image
        if total > limit:
            images = f"{num_images} image{'s' if num_images != 1 else ''}"
            raise InvalidInput(
                f"prompt is {total} tokens ({num_text} text + {num_image} image in {images}), "
                f"more than the limit of {limit}"
            )
        return total

    def build(self, ids: np.ndarray, images: list[PreparedImage]) -> Prompt:
        """The prompt of the template ids ``ids`` whose image placeholders are ``images``."""
        where = np.flatnonzero(ids == self._image_token_id)
        if len(where) != len(images):
            raise InvalidInput(
                f"the chat template rendered {len(where)} image placeholders for "
                f"{len(images)} images"
            )
        repeats = np.ones(len(ids), dtype=np.int64)
        repeats[where] = [im.num_tokens for im in images]
        input_ids = np.repeat(ids, repeats)
        image_mask = input_ids == self._image_token_id
        positions, delta = self._rope.positions(
            input_ids, image_mask, [im.grid_thw for im in images]
        )
        fill_ids = input_ids.astype(np.int32)
        shift = 0  # tokens added by the expansion of earlier images
        for start, image in zip(where, images, strict=True):
            start += shift
            shift += image.num_tokens - 1
            fill_ids[start : start + image.num_tokens] = pad_id_for(image.key, self._vocab_size)
        return Prompt(fill_ids, positions, delta, image_mask, list(images))
