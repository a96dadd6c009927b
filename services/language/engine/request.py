"""A request's state inside the engine.

The sequence of a request is its prompt followed by its generated tokens. ``slots[i]`` holds
the K/V of token ``i`` for ``i < num_computed``:

    | 0 .. num_tree      | num_tree .. num_computed | num_computed .. seq_len |
    | radix-owned slots  | request-owned slots      | not computed yet        |

``tree_node`` is the locked radix node whose path covers (at least) the first ``num_tree``
tokens. A step runs tokens ``[num_computed, num_computed + n)``; when that reaches ``seq_len``
the last row's logits are sampled and the new token is appended to the sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch

from services.language.engine.detokenizer import IncrementalDetokenizer
from services.language.engine.sampling import SamplerState, SamplingParams
from services.language.inputs import PromptInputs


class RequestStatus(IntEnum):
    WAITING_FOR_EMBEDDINGS = 0  # its room is still being received from the encoder
    WAITING = 1  # inputs complete, not admitted (or preempted, to recompute)
    PREFILL = 2  # admitted; prompt chunks left to run
    DECODE = 3  # generating one token per step
    FINISHED = 4


class FinishReason(IntEnum):
    """Mirrors ``epd.v1.FinishReason``."""

    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4


@dataclass
class RequestOutput:
    """What one step (or an abort) produced for one request; streamed to the caller."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason = FinishReason.NONE
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the radix cache
    num_completion_tokens: int = 0
    ttft_s: float = 0.0  # arrival -> first token
    total_s: float = 0.0  # arrival -> finish
    receive_s: float = 0.0  # arrival -> prompt complete (waiting for the encoder's embeddings)
    queue_s: float = 0.0  # prompt complete -> admitted to prefill
    prefill_s: float = 0.0  # admitted to prefill -> first token
    provenance: dict[str, float] = field(default_factory=dict)  # see PromptInputs.provenance
    error: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason != FinishReason.NONE


@dataclass(eq=False)
class Request:
    request_id: str
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    inputs: PromptInputs | None = None  # None while WAITING_FOR_EMBEDDINGS
    room: int = 0  # transfer room (0 = text-only / local inputs)
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    num_computed: int = 0
    num_tree: int = 0
    tree_node: Any = None
    num_cached_tokens: int = 0  # radix hit at first admission (usage report)
    image_row_offsets: torch.Tensor | None = None  # long [L+1]: image rows before token i
    sampler: SamplerState | None = None
    finish_reason: FinishReason = FinishReason.NONE
    arrival_time: float = field(default_factory=time.monotonic)
    inputs_time: float = 0.0  # prompt complete (embeddings received, or at once for text)
    prefill_start_time: float = 0.0  # first admitted to prefill
    first_token_time: float = 0.0

    def set_inputs(self, inputs: PromptInputs, vocab_size: int) -> None:
        self.inputs = inputs
        is_image = (inputs.fill_ids >= vocab_size).long()
        self.image_row_offsets = torch.cat([torch.zeros(1, dtype=torch.long), is_image.cumsum(0)])
        if int(self.image_row_offsets[-1]) != inputs.image_rows.shape[0]:
            raise ValueError(
                f"{int(self.image_row_offsets[-1])} image tokens but "
                f"{inputs.image_rows.shape[0]} image rows"
            )
        self.sampler = SamplerState.create(self.params)
        self.inputs_time = time.monotonic()

    @property
    def prompt_len(self) -> int:
        return len(self.inputs)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + len(self.output_ids)

    def seq_fill_ids(self, end: int | None = None) -> torch.Tensor:
        """Fill ids of tokens ``[0, end)`` of the sequence (prompt, then outputs)."""
        end = self.seq_len if end is None else end
        ids = self.inputs.fill_ids
        if end > self.prompt_len:
            ids = torch.cat([ids, torch.tensor(self.output_ids, dtype=torch.long)])
        return ids[:end]

    def positions(self, start: int, end: int) -> torch.Tensor:
        """M-RoPE positions [3, end - start]; generated tokens: index + delta on all axes."""
        p = self.prompt_len
        parts = [self.inputs.positions[:, start : min(end, p)]] if start < p else []
        if end > p:
            gen = torch.arange(max(start, p), end) + self.inputs.mrope_delta
            parts.append(gen.expand(3, -1))
        return torch.cat(parts, dim=1)

    def image_rows(self, start: int, end: int) -> torch.Tensor:
        """Image rows of the image tokens among ``[start, end)`` (prompt only)."""
        offsets = self.image_row_offsets
        lo, hi = int(offsets[min(start, self.prompt_len)]), int(offsets[min(end, self.prompt_len)])
        return self.inputs.image_rows[lo:hi]
