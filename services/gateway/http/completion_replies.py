"""The gateway's ``GenerateChunk``s -> OpenAI legacy completion JSON and Server-Sent Events.

A non-streamed answer is one ``text_completion`` object whose choice's ``text`` is the prompt
(with ``echo``) followed by the generated text. With ``logprobs`` its ``logprobs`` object lists
the tokens (the prompt's first with ``echo``: the first prompt token's logprob and top are
null), their logprobs, their top tokens and their offsets in the text (as counted by the
tokens' own text, from 0). Streamed, each event is a ``text_completion`` with the choice's text
delta: the first one carries the echoed prompt and the prompt's entries (and vLLM's
``prompt_logprobs`` when asked), then each delta the entries of the tokens since the previous
one (as chat: ``replies.py``), the last one the finish reason; ``include_usage`` and
``data: [DONE]`` as for chat.
"""

from __future__ import annotations

from protos.epd.v1 import common_pb2, gateway_pb2
from services.gateway.http.completions import CompletionAsk
from services.gateway.http.logprobs import legacy_logprobs, vllm_prompt_logprobs
from services.gateway.http.replies import FINISH_REASONS, Head, StreamWriter, usage

OBJECT = "text_completion"


class CompletionWriter(StreamWriter):
    """One legacy completion answer: ``unary`` when not streamed, ``write`` when streamed."""

    object_name = OBJECT
    unary_object = OBJECT

    def __init__(self, head: Head, include_usage: bool, ask: CompletionAsk, index: int = 0) -> None:
        super().__init__(head, include_usage)
        self.ask = ask
        self.index = index  # the choice's in the answer (see ``choices.py``)
        self._offset = 0  # text_offset of the next token

    def _logprobs(self, entries: list[common_pb2.TokenLogprob]) -> dict | None:
        if self.ask.logprobs is None:
            return None
        out = legacy_logprobs(entries, self.ask.logprobs, self._offset)
        self._offset += sum(len(lp.token) for lp in entries)
        return out

    def _choice(self, text: str, entries: list, finish_reason: str | None = None) -> dict:
        return {
            "index": self.index,
            "text": text,
            "logprobs": self._logprobs(entries),
            "finish_reason": finish_reason,
        }

    def _prompt_part(self, chunks: list[gateway_pb2.GenerateChunk]) -> tuple[str, list, dict]:
        """The echoed prompt's text and entries, and the extension's ``prompt_logprobs``."""
        entries = [lp for c in chunks for lp in c.prompt_logprobs]
        extra = {}
        if self.ask.prompt_logprobs is not None:
            extra["prompt_logprobs"] = vllm_prompt_logprobs(entries, self.ask.prompt_logprobs)
        if not self.ask.echo:
            return "", [], extra
        return "".join(c.prompt_text for c in chunks), entries, extra

    def unary(self, chunks: list[gateway_pb2.GenerateChunk]) -> dict:
        """The ``text_completion`` of all of an answer's chunks (the last one final)."""
        final = chunks[-1]
        choice = self.unary_choice(chunks)
        return self.envelope(OBJECT, [choice], usage=usage(final.usage), system_fingerprint=None)

    def unary_choice(self, chunks: list[gateway_pb2.GenerateChunk]) -> dict:
        """The choice of all of one prompt's chunks (the last one final)."""
        prompt_text, prompt_entries, extra = self._prompt_part(chunks)
        text = prompt_text + "".join(c.text for c in chunks)
        entries = prompt_entries + [lp for c in chunks for lp in c.logprobs]
        reason = FINISH_REASONS.get(chunks[-1].finish_reason, "stop")
        return self._choice(text, entries, reason) | extra

    def _start(self, chunk: gateway_pb2.GenerateChunk) -> bytes:
        """The echoed prompt and its entries, and ``prompt_logprobs``, when asked."""
        prompt_text, prompt_entries, extra = self._prompt_part([chunk])
        if not (prompt_text or extra):
            return b""
        return self.stream_event([self._choice(prompt_text, prompt_entries) | extra])
