"""Log-probabilities from the gateway's ``TokenLogprob`` protos in OpenAI's JSON shapes.

* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}``;
* legacy completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
  "text_offset"}`` (``legacy_logprobs``).

The worker sends each token's text and bytes, so nothing here needs a tokenizer. A logprob of
-inf (a token of probability 0) is written as ``MIN_LOGPROB``, as other servers do (JSON has no
infinity); NaN, the first prompt token's "no logprob", is written as null.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from protos.epd.v1 import common_pb2

MIN_LOGPROB = -9999.0


def json_logprob(value: float) -> float | None:
    if math.isnan(value):
        return None
    return max(value, MIN_LOGPROB)


def _top_entry(t: common_pb2.TopLogprob) -> dict:
    return {"token": t.token, "logprob": json_logprob(t.logprob), "bytes": list(t.token_bytes)}


def chat_entry(lp: common_pb2.TokenLogprob) -> dict:
    entry = {"token": lp.token, "logprob": json_logprob(lp.logprob), "bytes": list(lp.token_bytes)}
    entry["top_logprobs"] = [_top_entry(t) for t in lp.top]
    return entry


def chat_logprobs(entries: Iterable[common_pb2.TokenLogprob]) -> dict:
    """A chat choice's ``logprobs`` object."""
    return {"content": [chat_entry(lp) for lp in entries], "refusal": None}


def _legacy_top(lp: common_pb2.TokenLogprob, num_top: int) -> dict | None:
    """The chosen token and the ``num_top`` most likely ones, keyed by their text (None where
    it has no logprob). NOTE: tokens with the same text (two bytes of split characters are both
    U+FFFD) share a key: the chosen token's value wins, then the more likely one's."""
    if math.isnan(lp.logprob):
        return None
    top = {lp.token: json_logprob(lp.logprob)}
    for t in lp.top[:num_top]:
        top.setdefault(t.token, json_logprob(t.logprob))
    return top


def legacy_logprobs(entries: list[common_pb2.TokenLogprob], num_top: int, offset: int) -> dict:
    """A legacy completion choice's ``logprobs``: ``text_offset`` counts the characters of the
    tokens before each one, from ``offset`` (where these tokens' text starts in ``text``)."""
    offsets = []
    for lp in entries:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in entries],
        "token_logprobs": [json_logprob(lp.logprob) for lp in entries],
        "top_logprobs": [_legacy_top(lp, num_top) for lp in entries],
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(entries: list[common_pb2.TokenLogprob], num_top: int) -> list:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then per token ``{token id:
    {"logprob", "decoded_token", "rank"}}`` for it and its ``num_top`` most likely tokens
    (``rank`` 1 = most likely; the prompt token's only where it is among them)."""
    out: list = []
    for lp in entries:
        if math.isnan(lp.logprob):
            out.append(None)
            continue
        found = {}
        for rank, t in enumerate(lp.top[:num_top], start=1):
            found[str(t.token_id)] = {
                "logprob": json_logprob(t.logprob),
                "decoded_token": t.token,
                "rank": rank,
            }
        found.setdefault(
            str(lp.token_id), {"logprob": json_logprob(lp.logprob), "decoded_token": lp.token}
        )
        out.append(found)
    return out
