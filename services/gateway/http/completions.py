"""An OpenAI legacy completions body -> the gateway's ``GenerateRequest`` with a raw prompt.

The prompt is one text (tokenized by the language worker without the chat template) or one list
of token ids; a list of several prompts is refused (one request per prompt). ``logprobs`` (0..5)
asks for each token's log-probability and that many top tokens; with ``echo`` the prompt's
tokens come first, which needs the prompt's log-probabilities from the worker
(``sampling.prompt_logprobs``). ``prompt_logprobs`` is vLLM's extension. Checked here with a
400 naming the field: what only this endpoint has (``prompt``'s shape, ``suffix``, ``best_of``,
``logprobs``' bound); every other bound is the gateway's validation's, as for chat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protos.epd.v1 import gateway_pb2
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


def to_completion_request(
    body: CompletionRequest, request_id: str, limits: RequestLimits
) -> tuple[gateway_pb2.GenerateRequest, FieldNames, CompletionAsk]:
    """The proto of ``body``, how to name its fields and what its answer shows; raises
    ``HttpError`` (400)."""
    check_choices_and_stream(body)
    if body.suffix:
        raise invalid("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != 1:
        raise invalid(f"best_of must be 1, got {body.best_of}", "best_of")
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
    sampling = sampling_of(body, limits, names, DEFAULT_MAX_TOKENS)
    if body.logprobs is not None:
        sampling.logprobs, sampling.top_logprobs = True, body.logprobs
    wanted = [n for n in (body.prompt_logprobs,) if n is not None]
    if body.echo and body.logprobs is not None:
        wanted.append(body.logprobs)
    if wanted:
        sampling.prompt_logprobs = max(wanted)
    request = gateway_pb2.GenerateRequest(
        sampling=sampling, request_id=request_id, echo=bool(body.echo)
    )
    prompt = _one_prompt(body.prompt)
    if isinstance(prompt, str):
        request.prompt_text = prompt
    else:
        request.prompt_token_ids.extend(prompt)
    return request, names, CompletionAsk(bool(body.echo), body.logprobs, body.prompt_logprobs)


def _one_prompt(prompt: Any) -> str | list[int]:
    """The one prompt of ``prompt``: a string, a list of one string, a list of token ids or a
    list of one such list."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise invalid(
            "prompt must be a string, a list of token ids, or a list of one of them", "prompt"
        )
    if all(isinstance(p, str | list) for p in prompt):
        raise invalid(
            f"prompt holds {len(prompt)} prompts; one prompt per request is supported",
            "prompt",
        )
    for i, token_id in enumerate(prompt):
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise invalid(f"prompt[{i}] must be a token id (an integer)", f"prompt[{i}]")
        if not 0 <= token_id <= MAX_INT32:
            raise invalid(
                f"prompt[{i}] must be in [0, {MAX_INT32}], got {token_id}", f"prompt[{i}]"
            )
    return prompt
