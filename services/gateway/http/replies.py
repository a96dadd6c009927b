"""The gateway's ``GenerateChunk``s -> OpenAI chat completion JSON and Server-Sent Events.

A non-streamed answer is one ``chat.completion`` object. A streamed one is a sequence of
``data: <chat.completion.chunk>`` events: the first delta carries the role, each further one
the text the language worker produced (chunks with no text are skipped), the last one the
finish reason; with ``stream_options.include_usage`` every chunk has ``"usage": null`` and one
more chunk with no choices carries the usage. The stream ends with ``data: [DONE]``; an error
after the stream began is one ``data: {"error": ...}`` event before it.

Log-probabilities (``logprobs: true``) follow the tokens, one entry per generated token (the
end-of-turn token and the tokens that completed a stop string included, though their text is
not in the content), so their count is ``usage.completion_tokens``. A streamed delta carries the
entries of the tokens that arrived since the previous delta: text the worker holds back (a
possible stop string, part of a character) delays the entries with it, and the finish delta
carries what is left.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from protos.epd.v1 import common_pb2, gateway_pb2
from services.gateway.http.logprobs import chat_logprobs

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
DONE = b"data: [DONE]\n\n"


def dumps(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


# NOTE: JSON allows these raw inside strings and SSE splits lines on CR and LF only, but clients
# that split with str.splitlines (httpx's iter_lines, among others) break an event's line at them;
# generated text can hold any of them. Escaped, the JSON is the same and the line stays whole.
LINE_BREAKS_OUTSIDE_SSE = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_ESCAPE_LINE_BREAKS = str.maketrans(LINE_BREAKS_OUTSIDE_SSE)


def event(obj: dict) -> bytes:
    """One Server-Sent Event carrying ``obj`` as JSON, on one line for any line splitter."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + text.translate(_ESCAPE_LINE_BREAKS).encode() + b"\n\n"


def usage(u: gateway_pb2.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


@dataclass(frozen=True)
class Head:
    """What every object of one answer shares."""

    id: str
    created: int
    model: str


def tool_call(call: common_pb2.ToolCall) -> dict:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def completion(
    head: Head,
    text: str,
    final: gateway_pb2.GenerateChunk,
    logprobs: list[common_pb2.TokenLogprob] | None = None,
    calls: list[common_pb2.ToolCall] | None = None,
) -> dict:
    """The ``chat.completion`` object of one choice; ``logprobs`` None when not asked for."""
    return {
        "id": head.id,
        "object": "chat.completion",
        "created": head.created,
        "model": head.model,
        "choices": [completion_choice(text, final, logprobs, calls)],
        "usage": usage(final.usage),
        "system_fingerprint": None,
    }


def completion_choice(
    text: str,
    final: gateway_pb2.GenerateChunk,
    logprobs: list[common_pb2.TokenLogprob] | None = None,
    calls: list[common_pb2.ToolCall] | None = None,
    index: int = 0,
) -> dict:
    """One choice of a ``chat.completion``."""
    message: dict = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = [tool_call(c) for c in calls]
    return {
        "index": index,
        "message": message,
        "logprobs": None if logprobs is None else chat_logprobs(logprobs),
        "finish_reason": FINISH_REASONS.get(final.finish_reason, "stop"),
    }


class StreamWriter:
    """What every answer's events share: each is an object of ``object_name`` with one choice
    (or, for the usage, none); log-probability entries wait for the next choice that carries
    text, or for the finish. Subclasses say what a choice holds and what comes first."""

    object_name = ""  # of each event
    unary_object = ""  # of the answer's object when not streamed
    usage_event = True  # the usage's own event after the finish (with ``include_usage``)

    def __init__(self, head: Head, include_usage: bool) -> None:
        self.head = head
        self.include_usage = include_usage
        self._started = False
        self._pending: list[common_pb2.TokenLogprob] = []  # entries not sent yet

    def envelope(self, object_name: str, choices: list, **extra) -> dict:
        obj = {
            "id": self.head.id,
            "object": object_name,
            "created": self.head.created,
            "model": self.head.model,
            "choices": choices,
        }
        return obj | extra

    def stream_event(self, choices: list, **extra) -> bytes:
        nulls = {"usage": None} if self.include_usage else {}
        return event(self.envelope(self.object_name, choices, **(nulls | extra)))

    def _start(self, chunk: gateway_pb2.GenerateChunk) -> bytes:
        """The events before the first text (none by default)."""
        return b""

    def _entries(self, chunk: gateway_pb2.GenerateChunk) -> list[common_pb2.TokenLogprob]:
        """The log-probability entries of ``chunk`` the answer shows."""
        return list(chunk.logprobs)

    def _choice(self, text: str, entries: list, finish_reason: str | None) -> dict:
        raise NotImplementedError

    def _tool_calls(self, chunk: gateway_pb2.GenerateChunk) -> bytes:
        """The events of the tool calls ``chunk`` completed (none by default)."""
        return b""

    def write(self, chunk: gateway_pb2.GenerateChunk) -> bytes:
        """The events of one chunk from the gateway (possibly none)."""
        out = b""
        if not self._started:
            self._started = True
            out += self._start(chunk)
        self._pending += self._entries(chunk)
        if chunk.text:
            out += self.stream_event([self._choice(chunk.text, self._take(), None)])
        out += self._tool_calls(chunk)
        if chunk.finish_reason:
            reason = FINISH_REASONS.get(chunk.finish_reason, "stop")
            out += self.stream_event([self._choice("", self._take(), reason)])
            if self.include_usage and self.usage_event:
                out += self.stream_event([], usage=usage(chunk.usage))
        return out

    def _take(self) -> list[common_pb2.TokenLogprob]:
        taken, self._pending = self._pending, []
        return taken


class ChunkWriter(StreamWriter):
    """One chat answer: its events when streamed (``write``), its object when not (``unary``)."""

    object_name = "chat.completion.chunk"
    unary_object = "chat.completion"

    def __init__(
        self, head: Head, include_usage: bool, logprobs: bool = False, index: int = 0
    ) -> None:
        super().__init__(head, include_usage)
        self.logprobs = logprobs
        self.index = index  # the choice's in the answer (see ``choices.py``)
        self._num_calls = 0  # tool calls streamed so far (each delta's "index")

    def unary(self, chunks: list[gateway_pb2.GenerateChunk]) -> dict:
        """The ``chat.completion`` of all of an answer's chunks (the last one final)."""
        choice = self.unary_choice(chunks)
        final_usage = usage(chunks[-1].usage)
        return self.envelope(
            self.unary_object, [choice], usage=final_usage, system_fingerprint=None
        )

    def unary_choice(self, chunks: list[gateway_pb2.GenerateChunk]) -> dict:
        """The choice of all of one choice's chunks (the last one final)."""
        text = "".join(c.text for c in chunks)
        entries = [lp for c in chunks for lp in c.logprobs] if self.logprobs else None
        calls = [call for c in chunks for call in c.tool_calls]
        return completion_choice(text, chunks[-1], entries, calls, self.index)

    def _start(self, chunk: gateway_pb2.GenerateChunk) -> bytes:
        delta = {"role": "assistant", "content": ""}
        return self.stream_event(
            [{"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}]
        )

    def _entries(self, chunk: gateway_pb2.GenerateChunk) -> list[common_pb2.TokenLogprob]:
        return list(chunk.logprobs) if self.logprobs else []

    def _tool_calls(self, chunk: gateway_pb2.GenerateChunk) -> bytes:
        out = b""
        for call in chunk.tool_calls:
            delta = {"tool_calls": [{"index": self._num_calls, **tool_call(call)}]}
            choice = {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}
            out += self.stream_event([choice])
            self._num_calls += 1
        return out

    def _choice(self, text: str, entries: list, finish_reason: str | None) -> dict:
        return {
            "index": self.index,
            "delta": {"content": text} if text else {},
            "logprobs": chat_logprobs(entries) if entries else None,
            "finish_reason": finish_reason,
        }
