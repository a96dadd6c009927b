"""``unary_response``: a stream of interleaved choices put together as ``GenerateUnary`` answers
it (per-choice text, tokens, log-probabilities, finish and usage; choice 0 at the top level; the
request's usage summed; timing and workers from the last final chunk)."""

from __future__ import annotations

from protos.epd.v1 import common_pb2, gateway_pb2
from services.gateway.unary import total_usage, unary_response

LENGTH = common_pb2.FINISH_REASON_LENGTH
STOP = common_pb2.FINISH_REASON_STOP


def chunk(index: int, text: str, ids: list[int], **kw: object) -> gateway_pb2.GenerateChunk:
    logprobs = [common_pb2.TokenLogprob(token_id=i, logprob=-0.5) for i in ids]
    return gateway_pb2.GenerateChunk(
        request_id="r1", index=index, text=text, token_ids=ids, logprobs=logprobs, **kw
    )


def final(index: int, reason: int, completion: int, total_s: float) -> gateway_pb2.GenerateChunk:
    return chunk(
        index,
        "",
        [],
        finish_reason=reason,
        usage=gateway_pb2.Usage(prompt_tokens=7, cached_tokens=3, completion_tokens=completion),
        timing=gateway_pb2.Timing(total_s=total_s),
        language="lang:1",
        encoder="enc:1",
    )


def test_interleaved_choices_are_put_together_in_index_order() -> None:
    stream = [
        chunk(1, "b", [20], prompt_text="PROMPT"),
        chunk(0, "a", [10]),
        chunk(0, "c", [11]),
        final(0, LENGTH, 2, 1.0),
        chunk(1, "d", [21]),
        chunk(1, "e", [22]),
        final(1, STOP, 3, 2.0),
    ]
    reply = unary_response(stream)
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == ["ac", "bde"]
    assert [list(c.token_ids) for c in reply.choices] == [[10, 11], [20, 21, 22]]
    assert [[lp.token_id for lp in c.logprobs] for c in reply.choices] == [[10, 11], [20, 21, 22]]
    assert [c.finish_reason for c in reply.choices] == [LENGTH, STOP]
    assert [c.usage.completion_tokens for c in reply.choices] == [2, 3]
    assert all((c.usage.prompt_tokens, c.usage.cached_tokens) == (7, 3) for c in reply.choices)
    # choice 0 at the top level, the request's usage, the last final chunk's timing
    assert (reply.text, list(reply.token_ids), reply.finish_reason) == ("ac", [10, 11], LENGTH)
    assert [lp.token_id for lp in reply.logprobs] == [10, 11]
    assert (reply.usage.prompt_tokens, reply.usage.cached_tokens) == (7, 3)
    assert reply.usage.completion_tokens == 5
    assert reply.timing.total_s == 2.0
    assert (reply.request_id, reply.language, reply.encoder) == ("r1", "lang:1", "enc:1")
    assert reply.prompt_text == "PROMPT"


def test_one_choice_reads_as_before() -> None:
    reply = unary_response([chunk(0, "hi", [5]), chunk(0, " there", [6]), final(0, STOP, 2, 1.5)])
    (choice,) = reply.choices
    assert reply.text == choice.text == "hi there"
    assert list(reply.token_ids) == [5, 6]
    assert reply.usage == choice.usage
    assert reply.finish_reason == STOP


def test_total_usage_counts_the_prompt_once() -> None:
    finals = [final(i, LENGTH, 4, 1.0) for i in range(3)]
    assert total_usage(finals) == gateway_pb2.Usage(
        prompt_tokens=7, cached_tokens=3, completion_tokens=12
    )
