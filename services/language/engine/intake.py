"""A prompt entering a request: checked against the worker, then attached; the limits it is
checked against.

A prompt that can never be served is refused here with ``RequestError(INVALID_ARGUMENT)`` naming
the problem and the bound: text-only requests when they are submitted, requests with a room
when their prompt arrives. What passes is consistent with the model: one image row of the right
width per image token, no negative ids, prompt + completion within ``max_seq_len``. Sampling
settings that depend on the model (``logit_bias`` ids within the vocabulary) are checked when a
request is added.

A room's prompt may arrive in chunks (``take_chunk``: the request is queued with its first
tokens and prefills what arrived) and then whole (``take_whole``: it must start with the
tokens that came before). Each attaches or grows the request's inputs with their radix keys
(``radix_image_keys``); the engine queues a request the first time its prompt is attached.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from services.language.engine.request import ErrorKind, Request, RequestError
from services.language.engine.sampling import SamplingParams
from services.language.image_identity import image_keys, images_within
from services.language.inputs import PromptChunk, PromptInputs

logger = logging.getLogger(__name__)


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


def attach_prompt(
    req: Request, inputs: PromptInputs, limits: Limits, num_prompt_tokens: int | None = None
) -> None:
    """Check and attach a prompt, or the first tokens of one of ``num_prompt_tokens``."""
    max_new_tokens = check_inputs(inputs, req.params, limits, num_prompt_tokens)
    keys = radix_image_keys(req, inputs, limits.vocab_size)
    req.set_inputs(inputs, limits.vocab_size, keys, max_new_tokens, num_prompt_tokens)


def grow_prompt(req: Request, inputs: PromptInputs, limits: Limits) -> None:
    """``inputs`` (from the prompt's first token) replace the request's shorter ones."""
    check_inputs(inputs, req.params, limits, req.num_prompt_tokens)
    req.update_inputs(inputs, limits.vocab_size, radix_image_keys(req, inputs, limits.vocab_size))


def take_chunk(req: Request, chunk: PromptChunk, limits: Limits) -> bool:
    """The next tokens of ``req``'s prompt arrived; True when they are its first (``req`` is
    to be queued). ValueError for a chunk out of order."""
    if req.inputs is None:
        if chunk.start != 0:
            raise ValueError(f"the prompt's first chunk starts at token {chunk.start}")
        attach_prompt(req, chunk.inputs, limits, chunk.num_prompt_tokens)
        return True
    if chunk.start != req.num_ready_tokens:
        raise ValueError(f"chunk at token {chunk.start}, {req.num_ready_tokens} arrived")
    grow_prompt(req, req.inputs.extended(chunk.inputs), limits)
    return False


def take_whole(req: Request, inputs: PromptInputs, limits: Limits) -> bool:
    """``req``'s whole prompt arrived; True when none of it had (``req`` is to be queued).
    ValueError when it does not start with the chunks that came before it."""
    if req.inputs is None:
        attach_prompt(req, inputs, limits)
        return True
    # its first tokens came earlier (and may be computed): the whole prompt replaces them,
    # after checking that it starts with them
    arrived = req.num_ready_tokens
    if len(inputs) != req.num_prompt_tokens or not torch.equal(
        inputs.fill_ids[:arrived], req.inputs.fill_ids
    ):
        raise ValueError("the prompt differs from the chunks that arrived before it")
    grow_prompt(req, inputs, limits)
    return False


def radix_image_keys(req: Request, inputs: PromptInputs, vocab_size: int) -> np.ndarray:
    """Each token's image key for the radix cache (0 for text); a prefix of a prompt
    still arriving gets its images' keys as far as their tokens arrived."""
    images = images_within(inputs.images, len(inputs.image_rows))
    keys, problem = image_keys(inputs.fill_ids.numpy(), vocab_size, images)
    if problem:
        logger.warning(
            "request %s: its image tokens get a random radix key and will not be shared (%s)",
            req.request_id,
            problem,
        )
    return keys
