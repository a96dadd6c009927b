"""An OpenAI legacy completions body -> the gateway's ``GenerateRequest`` with a raw prompt.

A prompt is a text (tokenized by the language worker without the chat template) or a list of
token ids; a list of several prompts becomes one request per prompt (choice ``i`` answers
prompt ``i``; they are ``R-0``, ``R-1``, ... of the answer's id ``R``: ``X-Request-Id`` or one
drawn here); with ``n`` each has ``n`` choices, numbered ``i * n + j`` in the answer.
``logprobs`` (0..5) asks for each token's log-probability and that many top tokens; with
``echo`` the prompt's tokens come first, which needs the prompt's log-probabilities from the
worker (``sampling.prompt_logprobs``); ``echo`` with ``max_tokens`` 0 answers the prompt alone
(``prompt_only``). ``prompt_logprobs`` is vLLM's extension. Checked here with a 400 naming the
field: what only this endpoint has (``prompt``'s shape, ``suffix``, ``best_of``, ``logprobs``'
bound); every other bound is the gateway's validation's, as for chat.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from protos.epd.v1 import common_pb2, gateway_pb2
from services.gateway.http.convert import (
    MAX_INT32,
    FieldNames,
    check_choices_and_stream,
    sampling_of,
)
from services.gateway.http.errors import invalid
from services.gateway.http.schemas import MAX_LEGACY_LOGPROBS, CompletionRequest
from services.gateway.validation import MAX_TOP_LOGPROBS, RequestLimits

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for legacy completions


@dataclass(frozen=True)
class CompletionAsk:
    """What the answer's shape depends on."""

    echo: bool
    logprobs: int | None  # legacy top count; None = no logprobs object
    prompt_logprobs: int | None  # vLLM's extension; None = not asked
    prompt_only: bool = False  # ``echo`` with ``max_tokens`` 0: the prompt, nothing generated


def prompt_only(
    chunks: Iterator[gateway_pb2.GenerateChunk],
) -> Iterator[gateway_pb2.GenerateChunk]:
    """The chunks of a ``prompt_only`` answer: the one token generated (a request generates at
    least one) is dropped from the text, the tokens, the log-probabilities and the usage, and
    each choice ends with ``length`` (its budget of 0 was reached)."""
    for chunk in chunks:
        del chunk.token_ids[:], chunk.logprobs[:], chunk.tool_calls[:]
        chunk.text = ""
        if chunk.finish_reason:
            chunk.finish_reason = common_pb2.FINISH_REASON_LENGTH
            chunk.usage.completion_tokens = 0
        yield chunk


def to_completion_requests(
    body: CompletionRequest, request_id: str, limits: RequestLimits
) -> tuple[list[gateway_pb2.GenerateRequest], FieldNames, CompletionAsk]:
    """The protos of ``body`` (one per prompt), how to name its fields and what its answer
    shows; raises ``HttpError`` (400)."""
    check_choices_and_stream(body)
    if body.suffix:
        raise invalid("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of not in (1, body.n or 1):
        raise invalid(
            f"best_of must be 1 or equal to n ({body.n or 1}): each choice is returned, got "
            f"{body.best_of}",
            "best_of",
        )
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LEGACY_LOGPROBS:
        raise invalid(
            f"logprobs must be in [0, {MAX_LEGACY_LOGPROBS}], got {body.logprobs}", "logprobs"
        )
    if body.prompt_logprobs is not None and not 0 <= body.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid(
            f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.prompt_logprobs}",
            "prompt_logprobs",
        )
    names = FieldNames(renamed={"top_logprobs": "logprobs"})
    # NOTE: echo with max_tokens 0 asks for the prompt's log-probabilities alone (a scoring idiom
    # vLLM accepts): the worker generates one token, which ``prompt_only`` drops
    echo_only = bool(body.echo) and body.max_tokens == 0
    if echo_only:
        body = body.model_copy(update={"max_tokens": 1})
    sampling = sampling_of(body, limits, names, DEFAULT_MAX_TOKENS)
    if body.logprobs is not None:
        sampling.logprobs, sampling.top_logprobs = True, body.logprobs
    wanted = [n for n in (body.prompt_logprobs,) if n is not None]
    if body.echo and body.logprobs is not None:
        wanted.append(body.logprobs)
    if wanted:
        sampling.prompt_logprobs = max(wanted)
    prompts = _prompts(body.prompt, limits)
    if len(prompts) > 1 and not request_id:
        request_id = secrets.token_hex(16)  # the answer's; its prompts' are R-0, R-1, ...
    requests = []
    for i, prompt in enumerate(prompts):
        rid = f"{request_id}-{i}" if request_id and len(prompts) > 1 else request_id
        request = gateway_pb2.GenerateRequest(
            sampling=sampling, request_id=rid, echo=bool(body.echo)
        )
        if isinstance(prompt, str):
            request.prompt_text = prompt
        else:
            request.prompt_token_ids.extend(prompt)
        requests.append(request)
    ask = CompletionAsk(bool(body.echo), body.logprobs, body.prompt_logprobs, echo_only)
    return requests, names, ask


def _prompts(prompt: Any, limits: RequestLimits) -> list[str | list[int]]:
    """The prompts of ``prompt``: a string or a list of token ids is one; a list of strings or
    of lists of token ids is several (at most ``max_messages``, the bound on a chat's parts)."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [_prompt(prompt, "prompt")]
    if not isinstance(prompt, list) or not prompt:
        raise invalid("prompt must be a string, a list of token ids, or a list of either", "prompt")
    if len(prompt) > limits.max_messages:
        raise invalid(
            f"prompt holds {len(prompt)} prompts, more than the limit of {limits.max_messages}",
            "prompt",
        )
    return [_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]


def _is_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], str | list)


def _prompt(prompt: Any, where: str) -> str | list[int]:
    """One prompt: a non-empty string or list of token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise invalid(f"{where} must not be empty", where)
        return prompt
    if not _is_ids(prompt):
        raise invalid(f"{where} must be a string or a non-empty list of token ids", where)
    for i, token_id in enumerate(prompt):
        at = f"{where}[{i}]"
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise invalid(f"{at} must be a token id (an integer)", at)
        if not 0 <= token_id <= MAX_INT32:
            raise invalid(f"{at} must be in [0, {MAX_INT32}], got {token_id}", at)
    return prompt
