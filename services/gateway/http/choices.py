"""An answer of several choices: ``n`` > 1, a legacy completion of several prompts, or both.

Choice ``p * n + i`` of the answer is choice ``i`` (the chunks' ``index``) of prompt ``p`` (the
request whose chunks carry ``request_ids[p]``), as OpenAI and vLLM number them; each choice has
its own writer (``replies.ChunkWriter`` or ``completion_replies.CompletionWriter``) and so its
own role delta, log-probability entries, tool-call numbering and finish. Usage: each prompt's
tokens once (from its choice 0) and every choice's completion tokens; streamed, its event comes
once every choice finished.
"""

from __future__ import annotations

from collections.abc import Iterable

from protos.epd.v1 import gateway_pb2
from services.gateway.http.replies import StreamWriter, usage
from services.gateway.unary import total_usage


class ChoicesWriter:
    """The ``AnswerWriter`` of several choices (see the module's docstring)."""

    def __init__(
        self, writers: list[StreamWriter], request_ids: list[str], n: int, include_usage: bool
    ) -> None:
        if len(writers) != len(request_ids) * n:
            raise ValueError(f"{len(writers)} writers for {len(request_ids)} prompts of {n}")
        self.writers = writers  # writer k writes choice k
        self.prompt = {rid: p for p, rid in enumerate(request_ids)}
        self.n = n
        self.include_usage = include_usage
        for writer in writers:
            writer.usage_event = False  # one event with the sum instead
        self._finals: list[gateway_pb2.GenerateChunk] = []

    def position(self, chunk: gateway_pb2.GenerateChunk) -> int:
        """The answer's choice ``chunk`` belongs to."""
        return self.prompt[chunk.request_id] * self.n + chunk.index

    def unary(self, chunks: list[gateway_pb2.GenerateChunk]) -> dict:
        """The answer's object, one choice per writer in order."""
        by_choice: list[list[gateway_pb2.GenerateChunk]] = [[] for _ in self.writers]
        for chunk in chunks:
            by_choice[self.position(chunk)].append(chunk)
        choices = [w.unary_choice(c) for w, c in zip(self.writers, by_choice, strict=True)]
        first = self.writers[0]
        total = sum_usage(c[-1] for c in by_choice)
        return first.envelope(first.unary_object, choices, usage=total, system_fingerprint=None)

    def write(self, chunk: gateway_pb2.GenerateChunk) -> bytes:
        """The events of one chunk of one of the choices."""
        out = self.writers[self.position(chunk)].write(chunk)
        if chunk.finish_reason:
            self._finals.append(chunk)
            if self.include_usage and len(self._finals) == len(self.writers):
                out += self.writers[0].stream_event([], usage=sum_usage(self._finals))
        return out


def sum_usage(finals: Iterable[gateway_pb2.GenerateChunk]) -> dict:
    """The usage of the choices whose final chunks are ``finals`` (``unary.total_usage``)."""
    return usage(total_usage(finals))
