"""The official ``openai`` client against a live stack (gateway with HTTP, encoder, language).

Greedy answers through HTTP equal what gRPC ``Generate`` returns for the same messages (text,
and with an image sent as a data URL); streamed deltas concatenate to the non-streamed text;
usage is right, with cached prompt tokens on a repeat; the model list is the checkpoint's
name; sampling extensions (seed, top_k, stop strings) behave as on gRPC; the logits controls
(penalties, logit_bias, min_p, min_tokens) reach the worker as a gRPC client's do; refusals
arrive as the client's own exception types; both front doors count in one series, told apart
by ``api``; the status page's state follows the traffic.
"""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from protos.epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.language.model.config import TextModelConfig
from tests.http.conftest import ARCH, IMAGE_URL, image_message, outcomes, wait_for

MAX_TOKENS = 12


def to_proto(messages: list[dict]) -> list[common_pb2.ChatMessage]:
    """The same messages as gRPC protos."""
    out = []
    for message in messages:
        content = message["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        proto = common_pb2.ChatMessage(role=message["role"])
        for part in parts:
            if part["type"] == "text":
                proto.content.add(text=part["text"])
            else:
                proto.content.add(image=common_pb2.ImageSource(base64=part["image_url"]["url"]))
        out.append(proto)
    return out


def grpc_greedy(stack, messages: list[dict], max_tokens: int) -> gateway_pb2.GenerateResponse:
    sampling = common_pb2.SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    return grpc_generate(stack, messages, sampling)


def grpc_generate(
    stack, messages: list[dict], sampling: common_pb2.SamplingParams
) -> gateway_pb2.GenerateResponse:
    request = gateway_pb2.GenerateRequest(messages=to_proto(messages), sampling=sampling)
    with stack.channel() as channel:
        return gateway_pb2_grpc.GatewayStub(channel).GenerateUnary(request, timeout=120)


def test_models_lists_the_checkpoint(client, model) -> None:
    assert [m.id for m in client.models.list()] == [model]
    assert client.models.retrieve(model).owned_by == "epd-serve"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("not-" + model)


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
def test_greedy_equals_grpc_and_stream_concatenates(http_stack, client, model, with_image):
    tag = uuid.uuid4().hex[:8]  # a prompt of its own: nothing cached from other tests
    user = (
        image_message(f"What is in the picture? {tag}")
        if with_image
        else {"role": "user", "content": f"Tell me a story. {tag}"}
    )
    messages = [{"role": "system", "content": "Answer briefly."}, user]
    expected = grpc_greedy(http_stack, messages, MAX_TOKENS)
    reply = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.id.startswith("chatcmpl-") and reply.model == model
    assert reply.object == "chat.completion" and reply.created > 0
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == "length"
    usage = reply.usage
    assert usage.completion_tokens == MAX_TOKENS == len(expected.token_ids)
    assert usage.prompt_tokens == expected.usage.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason] == [
        "length"
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_usage_counts_cached_tokens_on_a_repeat(client, model) -> None:
    messages = [image_message(f"Describe it in detail. {uuid.uuid4().hex}")]
    first, second = (
        client.chat.completions.create(model=model, messages=messages, max_tokens=4).usage
        for _ in range(2)
    )
    assert second.prompt_tokens == first.prompt_tokens
    assert second.prompt_tokens_details.cached_tokens > first.prompt_tokens_details.cached_tokens
    assert 0 < second.prompt_tokens_details.cached_tokens <= second.prompt_tokens


def test_sampling_options(client, model) -> None:
    messages = [{"role": "user", "content": f"Count for me. {uuid.uuid4().hex}"}]

    def ask(**kw) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(model=model, messages=messages, **kw)

    greedy = ask(max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    text = greedy.choices[0].message.content
    assert (
        ask(max_tokens=MAX_TOKENS, extra_body={"top_k": 1, "ignore_eos": True})
        .choices[0]
        .message.content
        == text
    )  # top_k 1 is greedy whatever the temperature
    seeded = [
        ask(max_tokens=MAX_TOKENS, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
        for _ in range(2)
    ]
    assert seeded[0].choices[0].message.content == seeded[1].choices[0].message.content
    stop = next((text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].strip()), "")
    if stop:  # a stop string inside the greedy answer ends it there, excluded
        # ignore_eos as above: an end-of-sequence token (invisible in the text) must not end it
        stopped = ask(
            max_tokens=MAX_TOKENS, temperature=0, stop=stop, extra_body={"ignore_eos": True}
        )
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].message.content == text[: text.index(stop)]


def test_logits_controls_reach_the_worker_as_grpc_ones_do(http_stack, client, model) -> None:
    # a fixed prompt: greedy with and without the controls must differ, which a random prompt
    # does not always give on random weights (no repeated token for the penalties to act on)
    messages = [{"role": "user", "content": "Count for me, with the controls on."}]
    controls = dict(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.3)
    controls.update(min_p=0.1, min_tokens=3)
    sampling = common_pb2.SamplingParams(
        max_new_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={17: 2.0}, **controls
    )
    expected = grpc_generate(http_stack, messages, sampling)
    assert expected.token_ids != grpc_greedy(http_stack, messages, MAX_TOKENS).token_ids
    reply = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        frequency_penalty=controls.pop("frequency_penalty"),
        presence_penalty=controls.pop("presence_penalty"),
        logit_bias={"17": 2.0},
        extra_body={"ignore_eos": True, **controls},
    )
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.completion_tokens == MAX_TOKENS
    forced = common_pb2.SamplingParams(max_new_tokens=4, logit_bias={123: 100.0})
    assert list(grpc_generate(http_stack, messages, forced).token_ids) == [123] * 4


def test_min_tokens_decodes_past_a_forced_eos(client, model, tiny_model_dir) -> None:
    eos = TextModelConfig.from_pretrained(tiny_model_dir(ARCH)).eos_token_ids[0]
    messages = [{"role": "user", "content": f"Stop at once. {uuid.uuid4().hex}"}]
    for min_tokens, num_tokens in ((None, 1), (0, 1), (3, 4)):
        reply = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            logit_bias={str(eos): 100},
            extra_body={} if min_tokens is None else {"min_tokens": min_tokens},
        )
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens == num_tokens, min_tokens


def test_bad_logits_controls_are_400_naming_the_field(client, model, tiny_model_dir) -> None:
    vocab = TextModelConfig.from_pretrained(tiny_model_dir(ARCH)).vocab_size
    messages = [{"role": "user", "content": "Hi"}]
    cases = [
        (dict(frequency_penalty=3), "frequency_penalty", "in [-2, 2], got 3"),
        (dict(presence_penalty=-2.5), "presence_penalty", "in [-2, 2], got -2.5"),
        (dict(logit_bias={"5": 101}), "logit_bias", "in [-100, 100], got 101 for token 5"),
        (dict(logit_bias={"x": 1}), "logit_bias", "got 'x'"),
        # the worker knows its vocabulary: its refusal names the field too
        (
            dict(logit_bias={str(vocab): 1}),
            "logit_bias",
            f"logit_bias token ids must be in [0, {vocab})",
        ),
        (dict(extra_body={"repetition_penalty": 11}), "repetition_penalty", "(0, 10]"),
        (dict(extra_body={"min_p": 2}), "min_p", "in [0, 1], got 2"),
        (dict(max_tokens=2, extra_body={"min_tokens": 3}), "min_tokens", "max_tokens (2), got 3"),
    ]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=messages, **kwargs)
        assert info.value.body["param"] == param, kwargs
        assert words in info.value.body["message"], (words, info.value.body["message"])


def test_refusals_are_the_clients_exceptions(client, model) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=messages, temperature=500)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "temperature"
    assert "temperature must be a finite number in [0, 100]" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=messages)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:  # the encoder refuses a non-image
        bad = "data:image/png;base64,bm90IGFuIGltYWdl"
        client.chat.completions.create(model=model, messages=[image_message("?", bad)])
    assert "image" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=messages, n=17)
    assert info.value.body["param"] == "n"
    assert "n must be in [1, 16], got 17" in info.value.body["message"]
    # the test checkpoint's context is 32768 tokens: no language worker takes 32768 new ones
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=messages, max_tokens=32768)
    assert info.value.body["param"] == "max_tokens"
    assert "max_tokens is 32768, but" in info.value.body["message"]
    assert "max_seq_len" in info.value.body["message"]
    long_prompt = [{"role": "user", "content": "word " * 300}]
    with pytest.raises(openai.BadRequestError) as info:  # the language worker's own refusal
        client.chat.completions.create(model=model, messages=long_prompt, max_tokens=32700)
    assert "exceeds this worker's max_seq_len" in info.value.body["message"]


def test_both_front_doors_count_in_one_series(http_stack, client, model) -> None:
    before = outcomes(http_stack)
    client.chat.completions.create(model=model, messages=[image_message("Hi")], max_tokens=2)
    grpc_greedy(http_stack, [{"role": "user", "content": "Hi"}], 2)
    after = outcomes(http_stack)
    for api in ("http", "grpc"):
        assert after[("OK", api)] == before.get(("OK", api), 0) + 1, (api, after)


def test_image_url_is_the_same_image_as_grpc_base64(http_stack, client, model) -> None:
    """A data URL reaches the encoder as the same image a gRPC client sends as base64."""
    messages = [image_message(f"Same? {uuid.uuid4().hex[:6]}", IMAGE_URL)]
    expected = grpc_greedy(http_stack, messages, 6)
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": 1}
    )
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens_details.cached_tokens > 0  # the repeat hit the radix cache


def test_status_page_state_follows_the_traffic(http_stack, client, model) -> None:
    """``/dashboard/state`` samples what the gateway sees: requests/s by API, TTFT, transfer
    GB/s (image rows moved), and every worker with its queues, blocks and KV slots."""

    def busy_sample() -> dict | None:
        client.chat.completions.create(
            model=model, messages=[image_message(uuid.uuid4().hex)], max_tokens=2
        )
        grpc_greedy(http_stack, [image_message(uuid.uuid4().hex)], 2)
        state = httpx.get(http_stack.http_url + "/dashboard/state").json()
        for point in state["series"]:
            rates = point["requests_per_s"]
            if rates["http"] > 0 and rates["grpc"] > 0 and point["transfer_gb_s"] > 0:
                return state | {"point": point}
        return None

    state = wait_for(busy_sample, 60, "a sample with both APIs and a transfer")
    assert state["point"]["ttft_p50_ms"] > 0
    assert state["point"]["ttft_p99_ms"] >= state["point"]["ttft_p50_ms"]
    rows = {w["role"]: w for w in state["workers"]}
    assert set(rows) == {"encoder", "language"} and not state["show_addresses"]
    assert all(w["state"] == "healthy" and "address" not in w for w in state["workers"])
    assert rows["encoder"]["blocks"]["total"] > 0 and rows["language"]["blocks"]["total"] > 0
    assert rows["language"]["kv"]["total"] > 0 and rows["language"]["model"] == model
    assert state["pools"] == {"encoder": {"healthy": 1, "total": 1},
                              "language": {"healthy": 1, "total": 1}}  # fmt: skip
