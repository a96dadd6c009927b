"""The gateway's ``GenerateChunk``s -> OpenAI chat completion JSON and Server-Sent Events.

A non-streamed answer is one ``chat.completion`` object. A streamed one is a sequence of
``data: <chat.completion.chunk>`` events: the first delta carries the role, each further one
the text the language worker produced (chunks with no text are skipped), the last one the
finish reason; with ``stream_options.include_usage`` every chunk has ``"usage": null`` and one
more chunk with no choices carries the usage. The stream ends with ``data: [DONE]``; an error
after the stream began is one ``data: {"error": ...}`` event before it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from protos.epd.v1 import common_pb2, gateway_pb2

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
    head: Head, text: str, final: gateway_pb2.GenerateChunk, calls: list | None = None
) -> dict:
    message: dict = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = [tool_call(c) for c in calls]
    return {
        "id": head.id,
        "object": "chat.completion",
        "created": head.created,
        "model": head.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": FINISH_REASONS.get(final.finish_reason, "stop"),
            }
        ],
        "usage": usage(final.usage),
        "system_fingerprint": None,
    }


class ChunkWriter:
    """The events of one streamed answer."""

    def __init__(self, head: Head, include_usage: bool) -> None:
        self.head = head
        self.include_usage = include_usage
        self._started = False
        self._num_calls = 0  # tool calls streamed so far (each delta's "index")

    def _chunk(self, choices: list, **extra) -> bytes:
        obj = {
            "id": self.head.id,
            "object": "chat.completion.chunk",
            "created": self.head.created,
            "model": self.head.model,
            "choices": choices,
        }
        if self.include_usage:
            obj["usage"] = None
        obj.update(extra)
        return event(obj)

    def _delta(self, delta: dict, finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._chunk([choice])

    def write(self, chunk: gateway_pb2.GenerateChunk) -> bytes:
        """The events of one chunk from the gateway (possibly none)."""
        out = b""
        if not self._started:
            self._started = True
            out += self._delta({"role": "assistant", "content": ""})
        if chunk.text:
            out += self._delta({"content": chunk.text})
        for call in chunk.tool_calls:
            out += self._delta({"tool_calls": [{"index": self._num_calls, **tool_call(call)}]})
            self._num_calls += 1
        if chunk.finish_reason:
            out += self._delta({}, FINISH_REASONS.get(chunk.finish_reason, "stop"))
            if self.include_usage:
                out += self._chunk([], usage=usage(chunk.usage))
        return out
