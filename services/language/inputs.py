"""The engine's input for one prompt: what the encoder computed, in the engine's own type."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import torch

from services.language.image_identity import ImageRef, parse_images


@dataclass
class PromptInputs:
    """One fully assembled prompt.

    ``fill_ids`` holds real token ids for text and each image's hashed pad id (>= vocab_size) at
    its tokens; ``image_rows`` has one row per image token, in token order, each row
    ``[main | deepstack_0 | ...]`` (width ``hidden * (1 + num_deepstack)``).
    """

    fill_ids: torch.Tensor  # long [L]
    positions: torch.Tensor  # long [3, L] M-RoPE positions
    image_rows: torch.Tensor  # [num_image_tokens, hidden*(1+num_deepstack)]
    mrope_delta: int  # decode position of token i (i >= L) is i + mrope_delta on all axes
    num_deepstack: int = 0
    # The prompt's images in order (content hash, token count), for the radix key; None when
    # unknown (its image tokens are then keyed at random: never shared). () for text.
    images: tuple[ImageRef, ...] | None = None
    # Where the prompt came from, for the timing report: encode_s, num_encoder_cache_hits,
    # transfer_s, num_transfers (empty for text-only prompts).
    provenance: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fill_ids = torch.as_tensor(np.asarray(self.fill_ids), dtype=torch.long).flatten()
        self.positions = torch.as_tensor(np.asarray(self.positions), dtype=torch.long)
        if self.positions.shape != (3, self.fill_ids.shape[0]):
            raise ValueError(f"positions {tuple(self.positions.shape)} != (3, {len(self)})")
        if len(self) == 0:
            raise ValueError("empty prompt")

    def __len__(self) -> int:
        return int(self.fill_ids.shape[0])

    def extended(self, more: PromptInputs) -> PromptInputs:
        """This prompt's tokens followed by ``more``'s (the next tokens of a prompt that
        arrives in chunks); the images and provenance are ``more``'s (the latest known)."""
        return PromptInputs(
            fill_ids=torch.cat([self.fill_ids, more.fill_ids]),
            positions=torch.cat([self.positions, more.positions], dim=1),
            image_rows=torch.cat([self.image_rows, more.image_rows.to(self.image_rows.dtype)]),
            mrope_delta=self.mrope_delta,
            num_deepstack=self.num_deepstack,
            images=more.images,
            provenance=more.provenance,
        )

    @classmethod
    def from_text_ids(cls, token_ids: list[int], hidden_size: int) -> PromptInputs:
        """A text-only prompt: positions ``arange`` on all three axes, delta 0."""
        ids = torch.tensor(token_ids, dtype=torch.long)
        positions = torch.arange(len(token_ids)).expand(3, -1).clone()
        return cls(ids, positions, torch.zeros(0, hidden_size), 0, 0, images=())

    @classmethod
    def from_received(cls, received, num_deepstack: int) -> PromptInputs:
        """From the transfer plane's ``ReceivedEmbeddings`` (or the encoder pipeline's output):
        ``fill_ids`` int32[L], ``positions`` int32[3, L], ``image_rows``, ``aux.mrope_delta``
        and the images (hash, tokens) in ``aux.extra``."""
        return cls(
            fill_ids=received.fill_ids,
            positions=received.positions,
            image_rows=received.image_rows,
            mrope_delta=int(received.aux.mrope_delta),
            num_deepstack=num_deepstack,
            images=parse_images(getattr(received.aux, "extra", b"")),
            provenance=provenance_of(received),
        )


@dataclass
class PromptChunk:
    """Tokens ``[start, start + len(inputs))`` of a prompt of ``num_prompt_tokens`` that is
    still arriving (its room's chunks land one by one): the engine may prefill them already."""

    start: int
    inputs: PromptInputs
    num_prompt_tokens: int


def provenance_of(received) -> dict[str, float]:
    """Timing facts carried by a received prompt: the encoder's (in ``aux.extra``, JSON with
    ``encode_s`` and ``hits``) and the transfer's (``transfer_s``, ``num_transfers``)."""
    out: dict[str, float] = {}
    extra = getattr(received.aux, "extra", b"")
    if extra:
        try:
            meta = json.loads(extra)
        except ValueError:
            meta = {}
        if isinstance(meta, dict):
            out["encode_s"] = float(meta.get("encode_s", 0.0))
            hits = meta.get("hits", 0)
            out["num_encoder_cache_hits"] = float(sum(hits) if isinstance(hits, list) else hits)
    for name in ("transfer_s", "num_transfers"):
        if getattr(received, name, None) is not None:
            out[name] = float(getattr(received, name))
    return out
