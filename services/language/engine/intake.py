"""Checks a prompt against the worker before it is queued; the limits it is checked against.

A prompt that can never be served is refused here with ``RequestError(INVALID_ARGUMENT)`` naming
the problem and the bound: text-only requests when they are submitted, requests with a room
when their prompt arrives. What passes is consistent with the model: one image row of the right
width per image token, no negative ids, prompt + completion within ``max_seq_len``. Sampling
settings that depend on the model (``logit_bias`` ids within the vocabulary) are checked when a
request is added.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.language.engine.request import ErrorKind, RequestError
from services.language.engine.sampling import SamplingParams
from services.language.inputs import PromptInputs


@dataclass(frozen=True)
class Limits:
    vocab_size: int  # fill ids >= this are image tokens
    row_width: int  # hidden * (1 + num_deepstack): one received image row
    num_deepstack: int
    max_seq_len: int  # longest prompt + completion of one request
    default_max_new_tokens: int  # for requests that leave max_new_tokens unset


def invalid(message: str) -> RequestError:
    return RequestError(ErrorKind.INVALID_ARGUMENT, message)


def check_sampling(params: SamplingParams, limits: Limits) -> None:
    """What ``SamplingParams`` cannot check alone: ``logit_bias`` ids within the vocabulary."""
    for token_id, _ in params.logit_bias:
        if token_id >= limits.vocab_size:
            raise invalid(
                f"sampling.logit_bias token ids must be in [0, {limits.vocab_size}) (this "
                f"model's vocabulary), got {token_id}"
            )


def check_inputs(
    inputs: PromptInputs, params: SamplingParams, limits: Limits, num_tokens: int | None = None
) -> int:
    """The request's max_new_tokens once ``inputs`` are known to fit; RequestError if not.
    ``inputs`` may be the first tokens of a prompt of ``num_tokens`` still arriving."""
    num_tokens = len(inputs) if num_tokens is None else num_tokens
    max_new = params.max_new_tokens
    if max_new is None:
        max_new = min(limits.default_max_new_tokens, limits.max_seq_len - num_tokens)
        if max_new < 1:
            raise invalid(
                f"prompt is {num_tokens} tokens: with a new token it exceeds this worker's "
                f"max_seq_len {limits.max_seq_len}"
            )
    elif num_tokens + max_new > limits.max_seq_len:
        raise invalid(
            f"prompt is {num_tokens} tokens and max_new_tokens is {max_new}: "
            f"{num_tokens + max_new} exceeds this worker's max_seq_len {limits.max_seq_len}"
        )
    if int(inputs.fill_ids.min()) < 0:
        raise invalid("the prompt has negative token ids")
    num_image_tokens = int((inputs.fill_ids >= limits.vocab_size).sum())
    rows = inputs.image_rows
    if num_image_tokens != rows.shape[0]:
        raise invalid(f"{num_image_tokens} image tokens but {rows.shape[0]} image rows")
    if num_image_tokens:
        if inputs.num_deepstack != limits.num_deepstack:
            raise invalid(
                f"image rows carry {inputs.num_deepstack} deepstack rows, "
                f"this model takes {limits.num_deepstack}"
            )
        if rows.ndim != 2 or rows.shape[1] != limits.row_width:
            raise invalid(
                f"image rows are {tuple(rows.shape)}, this model needs width {limits.row_width}"
            )
        if not torch.is_floating_point(rows):
            raise invalid(f"image rows are {rows.dtype}, not floating point")
    return max_new
