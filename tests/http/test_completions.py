"""``POST /v1/completions`` (OpenAI's legacy completions) with the official ``openai`` client.

A string prompt and its token ids give the same greedy completion, equal to what gRPC's raw
prompt gives; streamed deltas concatenate to it; usage counts the raw prompt (no chat
template); ``echo`` puts the prompt first in the text and, with ``logprobs``, its tokens first
in the logprobs arrays (the first one's logprob null); vLLM's ``prompt_logprobs`` extension;
refusals name their field (``suffix``, ``best_of``, ``logprobs``, ``prompt``, ...).
"""

from __future__ import annotations

import json
import math
import uuid

import httpx
import openai
import pytest

from protos.epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.http.conftest import wait_for

MAX_TOKENS = 6


def grpc_raw(stack, text: str, max_tokens: int, **sampling) -> gateway_pb2.GenerateResponse:
    request = gateway_pb2.GenerateRequest(
        prompt_text=text,
        sampling=common_pb2.SamplingParams(max_new_tokens=max_tokens, ignore_eos=True, **sampling),
        echo=True,
    )
    with stack.channel() as channel:
        return gateway_pb2_grpc.GatewayStub(channel).GenerateUnary(request, timeout=120)


def test_string_and_token_prompts_equal_grpc_raw_prompt(http_stack, client, model) -> None:
    text = f"The quick brown fox {uuid.uuid4().hex[:8]}"
    expected = grpc_raw(http_stack, text, MAX_TOKENS, prompt_logprobs=0)
    ids = [p.token_id for p in expected.prompt_logprobs]
    ask = dict(model=model, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    reply = client.completions.create(prompt=text, **ask)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    choice = reply.choices[0]
    assert choice.text == expected.text and choice.finish_reason == "length"
    assert choice.logprobs is None and choice.index == 0
    usage = reply.usage
    assert usage.prompt_tokens == len(ids) == expected.usage.prompt_tokens  # no chat template
    assert usage.completion_tokens == MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + MAX_TOKENS
    for prompt in (ids, [ids], [text]):
        assert client.completions.create(prompt=prompt, **ask).choices[0].text == expected.text

    chunks = list(
        client.completions.create(
            prompt=text, stream=True, stream_options={"include_usage": True}, **ask
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in with_choices) == expected.text
    assert [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason] == [
        "length"
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_several_prompts_one_choice_each(http_stack, client, model) -> None:
    """A list of prompts is one request per prompt: choice i answers prompt i (the same text as
    that prompt alone), usage sums them; streamed, each prompt's deltas concatenate to its
    choice's text and the usage comes once, after every prompt finished."""
    tag = uuid.uuid4().hex[:6]
    texts = [f"First prompt {tag}", f"The second one {tag}", f"Third {tag}"]
    alone = [grpc_raw(http_stack, t, MAX_TOKENS) for t in texts]
    ask = dict(model=model, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    prompts = [texts[0], [p.token_id for p in grpc_raw(http_stack, texts[1], 1, prompt_logprobs=0)
                          .prompt_logprobs], texts[2]]  # fmt: skip
    reply = client.completions.create(prompt=prompts, logprobs=1, **ask)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [a.text for a in alone]
    assert all(len(c.logprobs.tokens) == MAX_TOKENS for c in reply.choices)
    assert reply.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert reply.usage.completion_tokens == 3 * MAX_TOKENS

    chunks = list(
        client.completions.create(
            prompt=prompts, stream=True, stream_options={"include_usage": True}, **ask
        )
    )
    for i, a in enumerate(alone):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == a.text
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    assert [c for c in chunks if not c.choices] == [chunks[-1]]
    assert chunks[-1].usage.completion_tokens == 3 * MAX_TOKENS
    assert len({c.id for c in chunks}) == 1


def test_default_max_tokens_is_16(client, model) -> None:
    reply = client.completions.create(
        model=model, prompt="Hello", temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == 16


def test_echo_with_logprobs_puts_the_prompt_first(http_stack, client, model) -> None:
    text = f"What is in this picture {uuid.uuid4().hex[:6]}"
    top = 2
    ask = dict(
        model=model,
        prompt=text,
        max_tokens=MAX_TOKENS,
        temperature=0,
        echo=True,
        logprobs=top,
        extra_body={"ignore_eos": True},
    )
    reply = client.completions.create(**ask)
    choice = reply.choices[0]
    num_prompt = reply.usage.prompt_tokens
    assert choice.text.startswith(text)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == num_prompt + MAX_TOKENS
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(lp.tokens[i] in lp.top_logprobs[i] for i in range(1, len(lp.tokens)))
    assert all(len(t) <= top + 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for i in range(num_prompt, len(lp.tokens)):  # greedy: the chosen one is the most likely
        assert math.isclose(lp.token_logprobs[i], max(lp.top_logprobs[i].values()), abs_tol=1e-6)

    expected = grpc_raw(http_stack, text, MAX_TOKENS, prompt_logprobs=top)
    assert choice.text == expected.prompt_text + expected.text
    for got, want in zip(
        lp.token_logprobs[1:num_prompt], expected.prompt_logprobs[1:], strict=True
    ):
        assert math.isclose(got, want.logprob, abs_tol=1e-4)

    chunks = list(client.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


def test_echo_with_max_tokens_0_is_the_prompt_alone(http_stack, client, model) -> None:
    """The scoring idiom: the prompt's text and log-probabilities, nothing generated."""
    text = f"Score this prompt {uuid.uuid4().hex[:6]}"
    ask = dict(model=model, prompt=text, max_tokens=0, echo=True, logprobs=1)
    reply = client.completions.create(**ask)
    choice = reply.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == reply.usage.prompt_tokens
    assert choice.logprobs.token_logprobs[0] is None
    expected = grpc_raw(http_stack, text, 1, prompt_logprobs=1)
    for got, want in zip(
        choice.logprobs.token_logprobs[1:], expected.prompt_logprobs[1:], strict=True
    ):
        assert math.isclose(got, want.logprob, abs_tol=1e-4)
    chunks = list(
        client.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as info:  # without echo, 0 is no request
        client.completions.create(model=model, prompt=text, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_logprobs_without_echo_and_prompt_logprobs_extension(client, model) -> None:
    text = f"Hello world {uuid.uuid4().hex[:6]}"
    reply = client.completions.create(
        model=model,
        prompt=text,
        max_tokens=3,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, "prompt_logprobs": 1},
    )
    choice = reply.choices[0]
    assert len(choice.logprobs.tokens) == 3  # the generated tokens only
    assert all(len(t) == 1 for t in choice.logprobs.top_logprobs)  # the chosen token alone
    prompt = choice.model_extra["prompt_logprobs"]
    assert len(prompt) == reply.usage.prompt_tokens and prompt[0] is None
    for entry in prompt[1:]:
        assert 1 <= len(entry) <= 2
        assert any(v.get("rank") == 1 for v in entry.values())


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"suffix": "end"}, "suffix", "suffix is not supported"),
        ({"best_of": 2}, "best_of", "best_of must be 1 or equal to n (1)"),
        ({"n": 2, "best_of": 3}, "best_of", "best_of must be 1 or equal to n (2)"),
        ({"n": 17}, "n", "n must be in [1, 16], got 17"),
        ({"logprobs": 6}, "logprobs", "logprobs must be in [0, 5], got 6"),
        ({"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs must be in [0, 20]"),
        ({"temperature": 500}, "temperature", "temperature must be a finite number"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1"),
        ({"prompt": ""}, "prompt", "prompt must not be empty"),
        ({"prompt": ["a", ""]}, "prompt[1]", "prompt[1] must not be empty"),
        ({"prompt": ["a", [1, True]]}, "prompt[1][1]", "must be a token id"),
        ({"prompt": ["x"] * 300}, "prompt", "prompt holds 300 prompts, more than the limit"),
        ({"prompt": [1, -2]}, "prompt[1]", "must be in [0, 2147483647], got -2"),
        ({"prompt": [1, 1 << 40]}, "prompt[1]", "must be in [0, 2147483647]"),
        ({"prompt": {"text": "x"}}, "prompt", "prompt must be a string"),
        # the worker's own refusal (it knows its vocabulary), named as the client sent it
        ({"prompt": [10**6]}, "prompt[0]", "prompt[0] must be in [0, "),
    ],
)
def test_refusals_name_the_field(client, model, extra, param, words) -> None:
    body = {"model": model, "prompt": "Hi", **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/completions", body=body, cast_to=object)
    if param is not None:
        assert info.value.body["param"] == param
    assert words in info.value.body["message"]


def entry(token_id: int, token: str, logprob: float, top: int = 0) -> common_pb2.TokenLogprob:
    tops = [common_pb2.TopLogprob(token_id=token_id, logprob=logprob, token=token)] if top else []
    return common_pb2.TokenLogprob(
        token_id=token_id, logprob=logprob, token=token, token_bytes=token.encode(), top=tops
    )


def test_writer_shapes_match_the_published_schema() -> None:
    """Unary and streamed answers validate as ``TextCompletion``; echo puts the prompt's text and
    entries first, with null for the first prompt token; offsets run on across events."""
    from services.gateway.http import schemas
    from services.gateway.http.completion_replies import CompletionWriter
    from services.gateway.http.completions import CompletionAsk
    from services.gateway.http.replies import Head

    first = gateway_pb2.GenerateChunk(
        text="",
        token_ids=[5],
        logprobs=[entry(5, " w", -0.5, 1)],
        prompt_logprobs=[entry(1, "He", float("nan")), entry(2, "llo", -1.0, 1)],
        prompt_text="Hello",
    )
    last = gateway_pb2.GenerateChunk(
        text=" wo",
        token_ids=[6],
        logprobs=[entry(6, "o", float("-inf"), 1)],
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=gateway_pb2.Usage(prompt_tokens=2, completion_tokens=2),
    )
    ask = CompletionAsk(echo=True, logprobs=1, prompt_logprobs=1)
    obj = CompletionWriter(Head("cmpl-x", 1, "m"), True, ask).unary([first, last])
    schemas.TextCompletion.model_validate(obj)
    choice = obj["choices"][0]
    assert choice["text"] == "Hello wo"
    assert choice["logprobs"] == {
        "tokens": ["He", "llo", " w", "o"],
        "token_logprobs": [None, -1.0, -0.5, -9999.0],
        "top_logprobs": [None, {"llo": -1.0}, {" w": -0.5}, {"o": -9999.0}],
        "text_offset": [0, 2, 5, 7],
    }
    assert choice["prompt_logprobs"] == [
        None,
        {"2": {"logprob": -1.0, "decoded_token": "llo", "rank": 1}},
    ]
    writer = CompletionWriter(Head("cmpl-x", 1, "m"), True, ask)
    raw = writer.write(first) + writer.write(last)
    events = [json.loads(e[len(b"data: ") :]) for e in raw.split(b"\n\n") if e]
    for e in events:
        schemas.TextCompletion.model_validate(e)
    streamed = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(c["text"] for c in streamed) == "Hello wo"
    offsets = [o for c in streamed if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == choice["logprobs"]["text_offset"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 4


def test_several_prompts_one_refused_cancels_the_others(http_stack, client, model) -> None:
    """A prompt the gateway refuses (too long) after another was admitted, or one the language
    worker refuses (a token id outside the vocabulary) while another runs: the answer is that
    400 and nothing of the other prompt is left in flight."""
    long_text = "x" * ((1 << 20) + 1)  # the gateway's max_text_chars, plus one
    for prompts, words in (
        (["Hello there", long_text], "prompt is 1048577 characters"),
        ([[5, 6, 7], [10**6]], "prompt[0] must be in [0, "),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt=prompts, max_tokens=200)
        assert words in info.value.body["message"]

    def idle() -> bool:
        state = httpx.get(http_stack.http_url + "/dashboard/state").json()
        return state["in_flight"] == 0

    wait_for(idle, 30, "no request in flight at the gateway")
    http_stack.wait_no_leaks()
    assert client.completions.create(model=model, prompt=["a", "b"], max_tokens=2).choices


def test_a_body_that_is_no_object_names_prompt(http_stack) -> None:
    reply = httpx.post(http_stack.http_url + "/v1/completions", content=b"[1, 2]")
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "request body must be a JSON object with prompt"
