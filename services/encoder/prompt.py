"""Chat messages + prepared images and videos -> fill ids and M-RoPE positions (``Prompt``).

The template renders each image as ``<|vision_start|><|image_pad|><|vision_end|>`` (a video with
``<|video_pad|>``). We tokenize the rendered text once, then expand every placeholder id to the
item's tokens (the pad is a special token, so this equals tokenizing the expanded text; Qwen3-VL
videos add each frame group's timestamp text), compute positions with transformers'
``get_rope_index`` (image tokens type 1, video tokens type 2, each video's grid and seconds per
frame group), and only then replace each item's ids by its pad id (one per image or video).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.multimodal import pad_id_for

from .checkpoint import Checkpoint
from .errors import InvalidInput
from .rope import RopeIndexer
from .types import ChatMessage, MediaItem, PreparedImage, PreparedVideo, Prompt

RESERVED_TEXT = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def template_messages(messages: tuple[ChatMessage, ...] | list[ChatMessage]) -> list[dict]:
    """Domain messages -> the dicts the chat template takes (``{"type": "image"}``, ``{"type":
    "video"}``)."""
    out = []
    for message in messages:
        parts = []
        for part in message.content:
            if part.image is not None:
                parts.append({"type": "image"})
            elif part.video is not None:
                parts.append({"type": "video"})
            else:
                text = part.text or ""
                for token in RESERVED_TEXT:
                    if token in text:
                        raise InvalidInput(f"text contains the reserved token {token}")
                parts.append({"type": "text", "text": text})
        out.append({"role": message.role, "content": parts})
    return out


@dataclass(frozen=True)
class MediaShape:
    """What a placeholder expands to: an image or a video of ``grid_thw`` (a video's frame
    groups at ``timestamps`` seconds)."""

    grid_thw: tuple[int, int, int]
    is_video: bool = False
    timestamps: tuple[float, ...] = ()

    @classmethod
    def of(cls, item: MediaItem) -> MediaShape:
        if isinstance(item, PreparedVideo):
            return cls(item.grid_thw, True, tuple(item.timestamps))
        return cls(item.grid_thw)


class PromptBuilder:
    def __init__(self, checkpoint: Checkpoint) -> None:
        self._tokenizer = checkpoint.tokenizer
        self._image_token_id = checkpoint.image_token_id
        self._video_token_id = checkpoint.video_token_id
        self._vocab_size = checkpoint.vocab_size
        self._merge = checkpoint.merge_size
        self._timestamps = checkpoint.video_timestamps_in_prompt
        self._vision_start = self._tokenizer.convert_tokens_to_ids("<|vision_start|>")
        self._vision_end = self._tokenizer.convert_tokens_to_ids("<|vision_end|>")
        self._rope = RopeIndexer(checkpoint)

    def text_ids(self, messages: list[dict]) -> np.ndarray:
        """Token ids of the rendered template, one placeholder id per image and per video."""
        text = self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return np.asarray(self._tokenizer(text)["input_ids"], dtype=np.int64)

    def expansion(self, shape: MediaShape) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, mm types: 0 text, 1 image, 2 video) one placeholder expands to.

        Qwen3-VL (its processor's ``replace_video_token``): per frame group
        ``<t seconds><|vision_start|>`` + pads + ``<|vision_end|>``. The timestamp text lies
        between special tokens, so tokenizing it alone gives the ids it gets in context."""
        t, h, w = shape.grid_thw
        per_group = h * w // self._merge**2
        if not shape.is_video:
            return np.full(t * per_group, self._image_token_id), np.ones(t * per_group, np.int64)
        if not self._timestamps:
            return np.full(t * per_group, self._video_token_id), np.full(t * per_group, 2)
        ids: list[int] = []
        types: list[int] = []
        for stamp in shape.timestamps:
            text = self._tokenizer(f"<{stamp:.1f} seconds>", add_special_tokens=False)
            head = [*text["input_ids"], self._vision_start]
            ids += head + [self._video_token_id] * per_group + [self._vision_end]
            types += [0] * len(head) + [2] * per_group + [0]
        return np.asarray(ids, np.int64), np.asarray(types, np.int64)

    def check_length(self, ids: np.ndarray, shapes: list[MediaShape], limit: int) -> int:
        """The prompt's length once each placeholder of ``ids`` is expanded for ``shapes``;
        ``InvalidInput`` when it exceeds ``limit``."""
        self._placeholders(ids, shapes)
        expanded = [self.expansion(s)[1] for s in shapes]
        num_media = sum(int((types > 0).sum()) for types in expanded)
        total = len(ids) - len(shapes) + sum(len(types) for types in expanded)
        if total > limit:
            num_text = total - num_media
            images = sum(not s.is_video for s in shapes)
            what = [f"{images} image{'s' if images != 1 else ''}"] if images or not shapes else []
            if len(shapes) > images:
                videos = len(shapes) - images
                what.append(f"{videos} video{'s' if videos != 1 else ''}")
            kind = "image" if len(shapes) == images else "image/video"
            raise InvalidInput(
                f"prompt is {total} tokens ({num_text} text + {num_media} {kind} in "
                f"{' and '.join(what)}), more than the limit of {limit}"
            )
        return total

    def build(self, ids: np.ndarray, items: list[MediaItem]) -> Prompt:
        """The prompt of the template ids ``ids`` whose placeholders are ``items``."""
        shapes = [MediaShape.of(item) for item in items]
        where = self._placeholders(ids, shapes)
        pieces: list[tuple[np.ndarray, np.ndarray, int]] = []  # (ids, mm types, item's pad id)
        prev = 0
        for start, item, shape in zip(where, items, shapes, strict=True):
            pieces.append((ids[prev:start], np.zeros(start - prev, np.int64), 0))
            pieces.append((*self.expansion(shape), pad_id_for(item.key, self._vocab_size)))
            prev = start + 1
        pieces.append((ids[prev:], np.zeros(len(ids) - prev, np.int64), 0))
        input_ids = np.concatenate([p[0] for p in pieces]).astype(np.int64)
        mm_types = np.concatenate([p[1] for p in pieces])
        pad_ids = np.concatenate([np.where(p[1] > 0, p[2], 0) for p in pieces])
        videos = [item for item in items if isinstance(item, PreparedVideo)]
        positions, delta = self._rope.positions(
            input_ids,
            mm_types,
            [s.grid_thw for s in shapes if not s.is_video],
            [v.grid_thw for v in videos],
            [v.second_per_grid_t for v in videos],
        )
        image_mask = mm_types > 0
        fill_ids = np.where(image_mask, pad_ids, input_ids).astype(np.int32)
        units: list[PreparedImage] = []
        for item in items:
            units += item.groups if isinstance(item, PreparedVideo) else [item]
        return Prompt(fill_ids, positions, delta, image_mask, units, list(items))

    def _placeholders(self, ids: np.ndarray, shapes: list[MediaShape]) -> np.ndarray:
        """Where each placeholder is; ``InvalidInput`` unless they match ``shapes`` in kind."""
        found = np.flatnonzero((ids == self._image_token_id) | (ids == self._video_token_id))
        kinds = [bool(ids[i] == self._video_token_id) for i in found]
        if kinds != [s.is_video for s in shapes]:
            want = ["video" if s.is_video else "image" for s in shapes]
            got = ["video" if k else "image" for k in kinds]
            raise InvalidInput(
                f"the chat template rendered placeholders {got} for the request's media {want}"
            )
        return found
