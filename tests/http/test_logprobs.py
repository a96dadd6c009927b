"""Log-probabilities through the HTTP API (the official ``openai`` client) and gRPC.

Chat with ``logprobs``/``top_logprobs``, streamed and not: one entry per generated token, the
greedy token is its step's most likely one, bytes decode to the token's text where they are whole
UTF-8, streamed entries concatenate to the non-streamed ones. gRPC: token text and bytes in
``logprobs``; a raw prompt with ``prompt_logprobs`` through the gateway.
"""

from __future__ import annotations

import math
import uuid

import openai
import pytest

from protos.epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

MAX_TOKENS = 8
TOP = 3


def check_entry(entry, num_top: int) -> None:
    """The chosen token is the top one (greedy) and its bytes are its text where whole."""
    assert len(entry.top_logprobs) == num_top
    best = entry.top_logprobs[0]
    assert (best.token, best.bytes) == (entry.token, entry.bytes)
    assert math.isclose(best.logprob, entry.logprob, abs_tol=1e-6) and entry.logprob <= 0
    assert [t.logprob for t in entry.top_logprobs] == sorted(
        (t.logprob for t in entry.top_logprobs), reverse=True
    )
    try:
        assert bytes(entry.bytes).decode() == entry.token
    except UnicodeDecodeError:  # part of a character: its text is the replacement character
        assert "\ufffd" in entry.token


def test_chat_logprobs_unary_and_streamed(client, model) -> None:
    messages = [{"role": "user", "content": f"Tell me a story. {uuid.uuid4().hex[:8]}"}]
    ask = dict(
        model=model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP,
        extra_body={"ignore_eos": True},
    )
    reply = client.chat.completions.create(**ask)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == MAX_TOKENS
    for entry in content:
        check_entry(entry, TOP)

    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in
                c.choices[0].logprobs.content]  # fmt: skip
    # the same tokens; the values within float noise (the repeat reuses the cached prompt)
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    for got, want in zip(streamed, content, strict=True):
        assert math.isclose(got.logprob, want.logprob, abs_tol=1e-4)
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]
    for c in chunks:  # text arrives with the entries of the tokens behind it
        if c.choices and c.choices[0].delta.content:
            assert c.choices[0].logprobs.content

    plain = client.chat.completions.create(**{**ask, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == reply.choices[0].message.content


def test_chat_logprobs_without_top(client, model) -> None:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 3 and all(e.top_logprobs == [] for e in content)


def test_chat_logprob_refusals(client, model) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=messages, top_logprobs=2)
    assert info.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=messages, logprobs=True, top_logprobs=21
        )
    assert info.value.body["param"] == "top_logprobs"
    assert "top_logprobs must be in [0, 20], got 21" in info.value.body["message"]


def test_grpc_raw_prompt_with_prompt_logprobs(http_stack) -> None:
    text = f"The quick brown fox {uuid.uuid4().hex[:6]}"
    sampling = common_pb2.SamplingParams(
        max_new_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=2, prompt_logprobs=2
    )
    with http_stack.channel() as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        reply = stub.GenerateUnary(
            gateway_pb2.GenerateRequest(prompt_text=text, sampling=sampling, echo=True),
            timeout=120,
        )
        prompt = reply.prompt_logprobs
        assert len(prompt) == reply.usage.prompt_tokens and reply.usage.cached_tokens == 0
        assert math.isnan(prompt[0].logprob) and not prompt[0].top
        assert all(p.logprob <= 0 and len(p.top) == 2 for p in prompt[1:])
        assert b"".join(p.token_bytes for p in prompt).decode() == text == reply.prompt_text
        assert len(reply.logprobs) == len(reply.token_ids) == 4
        assert all(lp.token == lp.top[0].token for lp in reply.logprobs)
        by_ids = stub.GenerateUnary(
            gateway_pb2.GenerateRequest(
                prompt_token_ids=[p.token_id for p in prompt], sampling=sampling
            ),
            timeout=120,
        )
        assert list(by_ids.token_ids) == list(reply.token_ids)
        assert [p.logprob for p in by_ids.prompt_logprobs[1:]] == [p.logprob for p in prompt[1:]]
        streamed = list(
            stub.Generate(gateway_pb2.GenerateRequest(prompt_text=text, sampling=sampling))
        )
        assert len(streamed[0].prompt_logprobs) == len(prompt)
        assert all(not c.prompt_logprobs for c in streamed[1:])
