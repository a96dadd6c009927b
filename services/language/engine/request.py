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

import numpy as np
import torch

from services.language.engine.detokenizer import IncrementalDetokenizer
from services.language.engine.penalties import TokenHistory
from services.language.engine.sampling import SamplerState, SamplingParams, TokenLogprob
from services.language.inputs import PromptInputs
from services.language.kvcache.key import make_key


class RequestStatus(IntEnum):
    WAITING_FOR_EMBEDDINGS = 0  # its room is still being received from the encoder
    WAITING = 1  # inputs complete, not admitted (or preempted, to recompute)
    PREFILL = 2  # admitted; prompt chunks left to run
    DECODE = 3  # generating one token per step
    FINISHED = 4
    # a choice other than the first of a request with ``n`` > 1: it waits for choice 0 to put
    # the prompt into the radix cache, then shares it (see ``engine.py``)
    WAITING_FOR_FIRST_CHOICE = 5


class FinishReason(IntEnum):
    """Mirrors ``epd.v1.FinishReason``."""

    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4


class ErrorKind(IntEnum):
    """Why a request finished with ``FinishReason.ERROR`` (the servicer maps it to gRPC)."""

    NONE = 0
    INVALID_ARGUMENT = 1  # it cannot be served as sent (bad prompt, longer than max_seq_len)
    DEADLINE_EXCEEDED = 2  # its deadline passed before its prompt arrived
    FAILED = 3  # it failed while being served (transfer, inputs, sampling, the model)


class RequestError(ValueError):
    """A request-level failure with its kind; the message names the problem."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


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
    error_kind: ErrorKind = ErrorKind.NONE
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token_ids, when asked
    # with the first token only: one per prompt token when asked (the first one's logprob NaN)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    index: int = 0  # the choice this output belongs to (0 .. n - 1)
    more_choices: bool = False  # finished, while other choices of the request go on

    @property
    def finished(self) -> bool:
        """Whether its choice finished."""
        return self.finish_reason != FinishReason.NONE

    @property
    def ends_request(self) -> bool:
        """Whether it is its request's last output: every choice finished."""
        return self.finished and not self.more_choices


@dataclass(eq=False)
class Request:
    """One sequence: a request with ``n`` choices is ``n`` of them sharing ``request_id``,
    choice ``index`` each (choice 0 receives and prefills the prompt; see ``engine.py``)."""

    request_id: str
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    index: int = 0
    inputs: PromptInputs | None = None  # None until its prompt's first tokens arrived
    num_prompt_tokens: int = 0  # the whole prompt's length (inputs may hold only a prefix)
    room: int = 0  # transfer room (0 = text-only / local inputs)
    deadline: float | None = None  # the caller's deadline (time.monotonic clock)
    max_new_tokens: int = 0  # params.max_new_tokens, or the default that fits max_seq_len
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    num_computed: int = 0
    num_tree: int = 0
    tree_node: Any = None
    num_cached_tokens: int = 0  # radix hit at first admission (usage report)
    image_row_offsets: torch.Tensor | None = None  # long [L+1]: image rows before token i
    prompt_key: np.ndarray | None = None  # radix key records of the prompt (see kvcache/key.py)
    sampler: SamplerState | None = None
    guide: Any = None  # structured output's ``grammar.Guide``, when the params ask for one
    token_history: TokenHistory | None = None  # for the penalties, built at its first use
    finish_reason: FinishReason = FinishReason.NONE
    arrival_time: float = field(default_factory=time.monotonic)
    inputs_time: float = 0.0  # prompt complete (embeddings received, or at once for text)
    prefill_start_time: float = 0.0  # first admitted to prefill
    first_token_time: float = 0.0
    # prompt tokens 1, 2, ...: each one's log-probability given the tokens before it, gathered
    # while the prompt is prefilled (see ``wants_prompt_logprobs``)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    def set_inputs(
        self,
        inputs: PromptInputs,
        vocab_size: int,
        image_keys: np.ndarray,
        max_new_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Attach a checked prompt (``engine/intake.py``), or the first tokens of a prompt of
        ``num_prompt_tokens`` still arriving; ``image_keys`` [L] is each token's image key (0
        for text)."""
        self.num_prompt_tokens = len(inputs) if num_prompt_tokens is None else num_prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.sampler = SamplerState.create(self.params)
        self.update_inputs(inputs, vocab_size, image_keys)

    def share_prompt(self, first: Request) -> None:
        """Take the prompt of choice 0 (``first``), whose prefill completed: the same inputs
        (its image rows included), radix key and prompt log-probabilities; the sequence then
        matches all of the prompt but its last token in the radix cache."""
        self.inputs, self.num_prompt_tokens = first.inputs, first.num_prompt_tokens
        self.max_new_tokens = first.max_new_tokens
        self.image_row_offsets, self.prompt_key = first.image_row_offsets, first.prompt_key
        self.prompt_logprobs = list(first.prompt_logprobs)
        self.arrival_time, self.inputs_time = first.arrival_time, first.inputs_time
        self.sampler = SamplerState.create(self.params)

    def update_inputs(self, inputs: PromptInputs, vocab_size: int, image_keys: np.ndarray) -> None:
        """More of the prompt arrived: ``inputs`` holds it from its first token."""
        self.inputs = inputs
        is_image = (inputs.fill_ids >= vocab_size).long()
        self.image_row_offsets = torch.cat([torch.zeros(1, dtype=torch.long), is_image.cumsum(0)])
        self.prompt_key = make_key(inputs.fill_ids.numpy(), image_keys)
        if self.prompt_complete:
            self.inputs_time = time.monotonic()

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt log-probabilities are still to gather: every prompt row must then be
        computed by this request itself, so the radix cache's prefix is not reused for it."""
        wanted = self.params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.prompt_len - 1

    @property
    def takes_row_maximum(self) -> bool:
        """Whether its next token is its logits' first maximum and nothing else is read from
        them: greedy, no log-probabilities, no logits controls, no structured output."""
        p = self.params
        return (
            p.temperature == 0
            and not p.wants_logprobs
            and not p.uses_logits_controls
            and self.guide is None
        )

    @property
    def prompt_len(self) -> int:
        return self.num_prompt_tokens

    @property
    def num_ready_tokens(self) -> int:
        """Prompt tokens that arrived (all of them once the prompt is complete)."""
        return len(self.inputs) if self.inputs is not None else 0

    @property
    def prompt_complete(self) -> bool:
        return self.num_ready_tokens == self.num_prompt_tokens

    @property
    def num_computable(self) -> int:
        """Tokens of the sequence that can be computed now: all of it once the prompt is
        complete, else the prompt tokens that arrived."""
        return self.seq_len if self.prompt_complete else self.num_ready_tokens

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

    def radix_key(self, end: int | None = None) -> np.ndarray:
        """Radix key records of tokens ``[0, end)``: the prompt's, then the generated tokens'."""
        end = self.seq_len if end is None else end
        if end <= self.prompt_len:
            return self.prompt_key[:end]
        generated = make_key(self.output_ids[: end - self.prompt_len])
        return np.concatenate([self.prompt_key, generated])

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
