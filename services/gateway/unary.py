"""``GenerateUnary``'s answer: the chunks ``Generate`` streams, put together in one message.

Chunks are grouped by their choice ``index``: a choice's text, tokens, log-probabilities and tool
calls are its chunks' in order, its finish reason and usage those of its final chunk. The
response's top-level answer fields are choice 0's (what a one-choice client reads); ``usage`` is
the request's (``total_usage``); timing and workers are the last final chunk's (it came once
every choice finished); prompt log-probabilities and prompt text are the request's.
"""

from __future__ import annotations

from collections.abc import Iterable

from protos.epd.v1 import gateway_pb2

Choice = gateway_pb2.GenerateResponse.Choice


def unary_response(chunks: Iterable[gateway_pb2.GenerateChunk]) -> gateway_pb2.GenerateResponse:
    """The response of the stream ``chunks`` (see the module's docstring)."""
    reply = gateway_pb2.GenerateResponse()
    choices: dict[int, Choice] = {}
    texts: dict[int, list[str]] = {}
    finals: list[gateway_pb2.GenerateChunk] = []
    for chunk in chunks:
        choice = choices.setdefault(chunk.index, Choice(index=chunk.index))
        texts.setdefault(chunk.index, []).append(chunk.text)
        choice.token_ids.extend(chunk.token_ids)
        choice.logprobs.extend(chunk.logprobs)
        choice.tool_calls.extend(chunk.tool_calls)
        reply.prompt_logprobs.extend(chunk.prompt_logprobs)
        reply.prompt_text += chunk.prompt_text
        if chunk.finish_reason:
            choice.finish_reason = chunk.finish_reason
            choice.usage.CopyFrom(chunk.usage)
            finals.append(chunk)
    for index, choice in sorted(choices.items()):
        choice.text = "".join(texts[index])
        reply.choices.append(choice)
    if reply.choices:
        _copy_answer(reply.choices[0], reply)
    if finals:  # always, once Generate ended without an error
        last = finals[-1]
        reply.request_id = last.request_id
        reply.encoder = last.encoder
        reply.language = last.language
        reply.timing.CopyFrom(last.timing)
        reply.usage.CopyFrom(total_usage(finals))
    return reply


def total_usage(finals: Iterable[gateway_pb2.GenerateChunk]) -> gateway_pb2.Usage:
    """The usage of the choices whose final chunks are ``finals``: the prompt and cached tokens
    of each prompt once (from its choice 0), the completion tokens of every choice."""
    total = gateway_pb2.Usage()
    for final in finals:
        if final.index == 0:
            total.prompt_tokens += final.usage.prompt_tokens
            total.cached_tokens += final.usage.cached_tokens
        total.completion_tokens += final.usage.completion_tokens
    return total


def _copy_answer(choice: Choice, reply: gateway_pb2.GenerateResponse) -> None:
    """Choice 0 into the top-level fields a one-choice client reads."""
    reply.text = choice.text
    reply.token_ids.extend(choice.token_ids)
    reply.finish_reason = choice.finish_reason
    reply.logprobs.extend(choice.logprobs)
    reply.tool_calls.extend(choice.tool_calls)
