"""What only the HTTP API refuses, on the same gateway as test_bad_inputs.py: the shape of
messages and parts, image URL forms, ``n``, fields asking for what this server does not do,
values the proto cannot hold, JSON and types; then the other statuses (404 model and path, 405,
413, 503 with ``Retry-After``) and the model routes. Each refused chat completion counts under
its outcome with ``api="http"``."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.http.refusals import (
    MAX_MESSAGE_MB,
    SERVED,
    TINY_URL,
    Gateway,
    add_image,
    add_message,
    assert_error,
    base,
    counted_refusals,
    edit,
    limits_gateway,
    post,
)

HTTP_ONLY: dict[str, tuple[dict | bytes, str | None, list[str]]] = {
    "n of 17": (edit(lambda b: None, n=17), "n", ["n must be in [1, 16], got 17"]),
    "stream_options without stream": (
        edit(lambda b: None, stream_options={"include_usage": True}),
        "stream_options",
        ["only allowed when stream is true"],
    ),
    "content a number": (
        edit(lambda b: b["messages"][0].update(content=5)),
        "messages[0].content",
        ["must be a string or a list of content parts, got a number"],
    ),
    "content missing": (
        edit(lambda b: b["messages"][0].pop("content")),
        "messages[0].content",
        ["got null"],
    ),
    "message not an object": (
        edit(lambda b: b["messages"].append("hi")),
        "messages[1]",
        ["messages[1] must be an object"],
    ),
    "unknown part type": (
        edit(lambda b: b["messages"][0]["content"].append({"type": "input_audio"})),
        "messages[0].content[2].type",
        ["must be 'text', 'image_url' or 'video_url', got 'input_audio'"],
    ),
    "text part without text": (
        edit(lambda b: b["messages"][0]["content"].append({"type": "text", "text": 3})),
        "messages[0].content[2].text",
        ["must be a string"],
    ),
    "image_url a string": (
        edit(
            lambda b: b["messages"][0]["content"].append(
                {"type": "image_url", "image_url": TINY_URL}
            )
        ),  # fmt: skip
        "messages[0].content[2].image_url",
        ["must be an object with a string url"],
    ),
    "data URL not base64": (
        edit(lambda b: add_image(b, "data:image/png,%89PNG")),
        "messages[0].content[2].image_url.url",
        ["must be a base64 data URL"],
    ),
    "ftp URL": (
        edit(lambda b: add_image(b, "ftp://example.com/a.png")),
        "messages[0].content[2].image_url.url",
        ["got scheme 'ftp'"],
    ),
    "no scheme": (
        edit(lambda b: add_image(b, "cat.png")),
        "messages[0].content[2].image_url.url",
        ["got no scheme"],
    ),
    "negative top_logprobs": (
        edit(lambda b: None, logprobs=True, top_logprobs=-1),
        "top_logprobs",
        ["top_logprobs must be in [0, 20], got -1"],
    ),
    "top_logprobs without logprobs": (
        edit(lambda b: None, top_logprobs=2),
        "top_logprobs",
        ["top_logprobs is only allowed when logprobs is true"],
    ),
    "tool without a function": (
        edit(lambda b: None, tools=[{"type": "function"}]),
        "tools[0].function",
        ["tools[0].function must be an object with a string name"],
    ),
    "unknown response format": (
        edit(lambda b: None, response_format={"type": "yaml"}),
        "response_format.type",
        ["response_format.type must be 'text', 'json_object' or 'json_schema', got 'yaml'"],
    ),
    "logit_bias key not a number": (
        edit(lambda b: None, logit_bias={"12": 1.0, "dog": 2.0}),
        "logit_bias",
        ["logit_bias keys must be token ids written as strings of digits, got 'dog'"],
    ),
    "logit_bias id past int32": (
        edit(lambda b: None, logit_bias={str(1 << 40): 1.0}),
        "logit_bias",
        ["logit_bias token ids must be in [0, 2147483647]"],
    ),
    "logit_bias id twice": (
        edit(lambda b: None, logit_bias={"7": 1.0, "007": 2.0}),
        "logit_bias",
        ["token id 7 twice"],
    ),
    "logit_bias value a word": (
        edit(lambda b: None, logit_bias={"7": "up"}),
        "logit_bias.7",
        ["logit_bias.7: Input should be a valid number"],
    ),
    "repetition_penalty 0": (
        edit(lambda b: None, repetition_penalty=0),
        "repetition_penalty",
        ["repetition_penalty must be a finite number in (0, 10], got 0"],
    ),
    "negative min_tokens": (
        edit(lambda b: None, min_tokens=-1),
        "min_tokens",
        ["min_tokens must be in [0, 4294967295], got -1"],
    ),
    "min_tokens above max_completion_tokens": (
        edit(lambda b: None, max_completion_tokens=3, min_tokens=4),
        "min_tokens",
        ["min_tokens must be at most max_completion_tokens (3), got 4"],
    ),
    "max_tokens 0": (edit(lambda b: None, max_tokens=0), "max_tokens", ["at least 1, got 0"]),
    "max_completion_tokens past uint32": (
        edit(lambda b: None, max_completion_tokens=1 << 40),
        "max_completion_tokens",
        ["max_completion_tokens must be at most 500"],
    ),
    "max_completion_tokens above the limit": (
        edit(lambda b: None, max_completion_tokens=501, max_tokens=5),
        "max_completion_tokens",
        ["max_completion_tokens must be at most 500, got 501"],
    ),
    "top_k past int32": (edit(lambda b: None, top_k=1 << 40), "top_k", ["[-1, 1000]"]),
    "seed past uint64": (edit(lambda b: None, seed=1 << 65), "seed", ["seed must be in"]),
    "stop id past int32": (
        edit(lambda b: None, stop_token_ids=[1 << 40]),
        "stop_token_ids[0]",
        ["must be in [0, 2147483647]"],
    ),
    "temperature a word": (
        edit(lambda b: None, temperature="hot"),
        "temperature",
        ["temperature: Input should be a valid number"],
    ),
    "stop a number": (edit(lambda b: None, stop=5), "stop", ["stop: "]),
    "messages an object": (edit(lambda b: None, messages={}), "messages", ["messages: "]),
    "not JSON": (b'{"messages": [', None, ["request body is not valid JSON"]),
    "a JSON list": (b"[1, 2]", None, ["request body must be a JSON object"]),
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[Gateway]:
    yield from limits_gateway(tmp_path_factory.mktemp("refusals"))


@pytest.fixture(scope="module")
def sent() -> dict[str, int]:
    """Chat completions answered so far, by outcome (checked against the gateway's metrics)."""
    return {}


@pytest.mark.parametrize("name", list(HTTP_ONLY))
def test_http_only_bad_input_is_400(gateway, sent, name: str) -> None:
    body, param, words = HTTP_ONLY[name]
    error = assert_error(post(gateway, body), 400, param, words)
    assert error["type"] == "invalid_request_error"
    sent["INVALID_ARGUMENT"] = sent.get("INVALID_ARGUMENT", 0) + 1


def test_other_refusals(gateway, sent) -> None:
    error = assert_error(post(gateway, edit(lambda b: None, model="gpt-4o")), 404, "model",
                         ["'gpt-4o' does not exist", SERVED])  # fmt: skip
    assert error["code"] == "model_not_found"
    sent["NOT_FOUND"] = 1
    big = edit(lambda b: add_message(b, content="z" * (MAX_MESSAGE_MB << 20)))
    error = assert_error(post(gateway, big), 413, None, [f"limit of {MAX_MESSAGE_MB} MiB"])
    assert error["code"] == "request_too_large"
    sent["RESOURCE_EXHAUSTED"] = 1
    # not positive, below a millisecond (a fuzzer's 1.1e-308 was a 504), not finite
    for value in ("-1", "0", "1.1e-308", "0.0009", "inf", "nan"):
        timeout = {"X-Request-Timeout": value}
        assert_error(post(gateway, base(), timeout), 400, "X-Request-Timeout",
                     ["finite number of seconds, at least 0.001"])  # fmt: skip
        sent["INVALID_ARGUMENT"] = sent.get("INVALID_ARGUMENT", 0) + 1
    for stream in (False, True):  # a valid request with no worker to serve it
        reply = post(gateway, edit(lambda b: None, stream=stream))
        error = assert_error(reply, 503, None, ["no healthy language worker"])
        assert error["code"] == "unavailable" and reply.headers["retry-after"] == "1"
    sent["UNAVAILABLE"] = 2
    reply = httpx.get(gateway.url + "/v1/chat/completions")
    assert_error(reply, 405, None, ["Method Not Allowed"])
    assert_error(httpx.get(gateway.url + "/v2/nothing"), 404, None, ["Not Found"])
    with httpx.Client(base_url=gateway.url) as client:
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [SERVED]
        assert client.get(f"/v1/models/{SERVED}").json()["id"] == SERVED
        assert_error(client.get("/v1/models/other"), 404, "model", ["'other' does not exist"])


def test_refusals_count_under_their_outcome_with_api_http(gateway, sent) -> None:
    assert counted_refusals(gateway) == {k: float(v) for k, v in sent.items()}
