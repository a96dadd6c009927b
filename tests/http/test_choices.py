"""``n`` choices through the live stack, with the official ``openai`` client and over gRPC.

Greedy choices of a chat (text, or with an image) each equal the one-choice answer, numbered
0..n-1, streamed with their own index and finish; usage counts the prompt once and every
choice's completion; legacy completions of several prompts number choice j of prompt i as
i * n + j; a seed makes the choices differ from each other and repeat across requests; over
gRPC each chunk carries its choice's index, ``GenerateUnary`` answers every choice (greedy ones
equal to the one-choice answer, seeded ones reproducible, choice i the one-choice answer seeded
seed + i), and n above its bound is INVALID_ARGUMENT naming ``sampling.n`` on both methods (the
HTTP 400 naming ``n`` is in ``test_openai_client.py``); nothing is left held on the workers
afterwards.
"""

from __future__ import annotations

import uuid

import grpc
import pytest

from protos.epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.http.conftest import image_message

MAX_TOKENS = 6
GREEDY = dict(temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})


def chat(tag: str, with_image: bool) -> list[dict]:
    if with_image:
        return [image_message(f"What is in the picture? {tag}")]
    return [{"role": "user", "content": f"Tell me a story. {tag}"}]


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
def test_chat_choices_streamed_and_not(http_stack, client, model, with_image) -> None:
    messages = chat(uuid.uuid4().hex[:8], with_image)
    one = client.chat.completions.create(model=model, messages=messages, **GREEDY)
    reply = client.chat.completions.create(model=model, messages=messages, n=3, **GREEDY)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice in reply.choices:
        assert choice.message.content == one.choices[0].message.content
        assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == one.usage.prompt_tokens
    assert reply.usage.completion_tokens == 3 * MAX_TOKENS
    assert reply.usage.total_tokens == one.usage.prompt_tokens + 3 * MAX_TOKENS

    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    roles: dict[int, int] = {}
    usages = []
    for event in stream:
        if not event.choices:
            usages.append(event.usage)
            continue
        (choice,) = event.choices
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if choice.delta.role:
            roles[choice.index] = roles.get(choice.index, 0) + 1
        if choice.finish_reason:
            finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert texts == {i: one.choices[0].message.content for i in (0, 1)}
    assert finishes == {0: ["length"], 1: ["length"]} and roles == {0: 1, 1: 1}
    (usage,) = usages
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        one.usage.prompt_tokens,
        2 * MAX_TOKENS,
    )
    http_stack.wait_no_leaks()


def test_completions_number_choices_per_prompt(http_stack, client, model) -> None:
    tag = uuid.uuid4().hex[:8]
    prompts = [f"Once upon a time {tag}", f"The weather today {tag}"]
    singles = [
        client.completions.create(model=model, prompt=p, **GREEDY).choices[0].text for p in prompts
    ]
    reply = client.completions.create(model=model, prompt=prompts, n=2, best_of=2, **GREEDY)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [singles[0]] * 2 + [singles[1]] * 2
    assert reply.usage.completion_tokens == 4 * MAX_TOKENS
    one = client.completions.create(model=model, prompt=prompts[0], **GREEDY)
    stream = client.completions.create(model=model, prompt=prompts[0], n=2, stream=True, **GREEDY)
    texts: dict[int, str] = {}
    finishes: dict[int, int] = {}
    for event in stream:
        for choice in event.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finishes[choice.index] = finishes.get(choice.index, 0) + bool(choice.finish_reason)
    assert texts == {0: one.choices[0].text, 1: one.choices[0].text}
    assert finishes == {0: 1, 1: 1}
    http_stack.wait_no_leaks()


def test_a_seed_makes_choices_differ_and_repeat(client, model) -> None:
    messages = chat(uuid.uuid4().hex[:8], with_image=False)
    sampled = dict(temperature=1.0, max_tokens=16, seed=1234, extra_body={"ignore_eos": True})
    runs = [
        [c.message.content for c in client.chat.completions.create(
            model=model, messages=messages, n=2, **sampled
        ).choices]
        for _ in range(2)
    ]  # fmt: skip
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]


def test_grpc_streams_each_choice_with_its_index(http_stack) -> None:
    message = common_pb2.ChatMessage(role="user")
    message.content.add(text=f"Count to ten. {uuid.uuid4().hex[:8]}")
    sampling = common_pb2.SamplingParams(max_new_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    request = gateway_pb2.GenerateRequest(messages=[message], sampling=sampling)
    with http_stack.channel() as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        chunks = list(stub.Generate(request, timeout=120))
        finals = [c for c in chunks if c.finish_reason]
        assert sorted(c.index for c in finals) == [0, 1]
        assert all(c.usage.completion_tokens == MAX_TOKENS for c in finals)
        texts = ["".join(c.text for c in chunks if c.index == i) for i in (0, 1)]
        assert texts[0] == texts[1] and texts[0]
        request.sampling.n = 17
        for rpc in (stub.GenerateUnary, lambda r, **kw: list(stub.Generate(r, **kw))):
            with pytest.raises(grpc.RpcError) as info:
                rpc(request, timeout=120)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sampling.n must be in [0, 16]" in info.value.details()
    http_stack.wait_no_leaks()


def unary_request(tag: str, n: int, max_tokens: int, **sampling) -> gateway_pb2.GenerateRequest:
    message = common_pb2.ChatMessage(role="user")
    message.content.add(text=f"Tell me a story. {tag}")
    sampling = common_pb2.SamplingParams(
        max_new_tokens=max_tokens, ignore_eos=True, n=n, **sampling
    )
    return gateway_pb2.GenerateRequest(messages=[message], sampling=sampling)


def test_grpc_unary_answers_every_choice(http_stack) -> None:
    tag = uuid.uuid4().hex[:8]
    with http_stack.channel() as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        one = stub.GenerateUnary(unary_request(tag, 1, MAX_TOKENS), timeout=120)
        assert len(one.choices) == 1 and one.choices[0].text == one.text and one.text
        three = stub.GenerateUnary(unary_request(tag, 3, MAX_TOKENS), timeout=120)
        assert [c.index for c in three.choices] == [0, 1, 2]
        for choice in three.choices:
            assert (choice.text, list(choice.token_ids)) == (one.text, list(one.token_ids))
            assert choice.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert choice.usage.prompt_tokens == one.usage.prompt_tokens
            assert choice.usage.completion_tokens == MAX_TOKENS
        assert (three.text, three.finish_reason) == (one.text, one.finish_reason)
        assert three.usage.prompt_tokens == one.usage.prompt_tokens
        assert three.usage.completion_tokens == 3 * MAX_TOKENS

        seeded = dict(temperature=1.0, seed=1234)
        runs = [
            stub.GenerateUnary(unary_request(tag, 3, 16, **seeded), timeout=120) for _ in range(2)
        ]
        tokens = [[list(c.token_ids) for c in run.choices] for run in runs]
        assert tokens[0] == tokens[1]
        assert [c.text for c in runs[0].choices] == [c.text for c in runs[1].choices]
        assert all(len(t) == 16 for t in tokens[0]) and tokens[0][0] != tokens[0][1]
        assert runs[0].usage.completion_tokens == 3 * 16
        single = stub.GenerateUnary(
            unary_request(tag, 1, 16, temperature=1.0, seed=1235), timeout=120
        )
        assert list(single.token_ids) == tokens[0][1]  # choice i samples with seed + i
    http_stack.wait_no_leaks()
