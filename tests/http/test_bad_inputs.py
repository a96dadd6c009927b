"""Every bad input of the gRPC suite, through HTTP: the status and OpenAI's error JSON.

A gateway process with the same request limits as ``tests/gateway/test_validation.py`` (and no
workers: everything here is refused before routing) gets each of that suite's bad requests
written as OpenAI JSON, streamed and not, and must answer 400 with
``{"error": {"message", "type", "param", "code"}}`` whose ``param`` is the request's JSON path
and whose message names the field and its bound; each refusal counts under
``INVALID_ARGUMENT`` with ``api="http"``. (What only HTTP refuses: test_http_only_inputs.py.)
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest

from tests.gateway.test_validation import BAD
from tests.http.refusals import (
    TINY_URL,
    Gateway,
    add_image,
    add_message,
    assert_error,
    base,
    counted_refusals,
    edit,
    image_part,
    limits_gateway,
    post,
)

CASES: dict[str, tuple[dict, dict, str, list[str]]] = {
    "no messages": (edit(lambda b: None, messages=[]), {}, "messages", ["messages must not be"]),
    "too many messages": (
        edit(lambda b: [add_message(b) for _ in range(4)]),
        {},
        "messages",
        ["messages has 5 entries", "limit of 4"],
    ),
    "bad role": (
        edit(lambda b: b["messages"][0].update(role="robot")),
        {},
        "messages[0].role",
        ["messages[0].role", "system, user, assistant", "'robot'"],
    ),
    "empty role": (edit(lambda b: add_message(b, role="")), {}, "messages[1].role", ["''"]),
    "message without content": (
        edit(lambda b: add_message(b, content=[])),
        {},
        "messages[1].content",
        ["messages[1].content must not be empty"],
    ),
    "too many parts": (
        edit(lambda b: b["messages"][0]["content"].extend([{"type": "text", "text": "a"}] * 2)),
        {},
        "messages[0].content",
        ["messages[0].content has 4 parts", "limit of 3"],
    ),
    "empty part": (
        edit(lambda b: b["messages"][0]["content"].append({})),
        {},
        "messages[0].content[2].type",
        ["messages[0].content[2].type is required"],
    ),
    "too much text": (
        edit(lambda b: add_message(b, content="y" * 90)),
        {},
        "messages[1].content",
        ["messages[1].content brings the request's text to 102 characters", "limit of 100"],
    ),
    "too many images": (
        edit(lambda b: [add_message(b, content=image_part(TINY_URL)) for _ in range(2)]),
        {},
        "messages[2].content[0].image_url",
        ["messages[2].content[0].image_url is image 3", "limit of 2 images"],
    ),
    "image without source": (
        edit(lambda b: b["messages"][0]["content"].append({"type": "image_url", "image_url": {}})),
        {},
        "messages[0].content[2].image_url",
        ["messages[0].content[2].image_url must be an object with a string url"],
    ),
    "empty image data": (
        edit(lambda b: add_image(b, "data:image/png;base64,")),
        {},
        "messages[0].content[2].image_url.url",
        ["holds no image data"],
    ),
    "image too large": (
        edit(
            lambda b: b["messages"][0]["content"][0]["image_url"].update(
                url="data:image/png;base64," + "A" * 5000
            )
        ),  # fmt: skip
        {},
        "messages[0].content[0].image_url.url",
        ["messages[0].content[0].image_url.url is 5022 characters", "more than the limit of"],
    ),
    "base64 too long": (
        edit(lambda b: add_image(b, "data:image/png;base64," + "A" * 5000)),
        {},
        "messages[0].content[2].image_url.url",
        ["messages[0].content[2].image_url.url is 5022 characters", "limit of"],
    ),
    "empty base64": (
        edit(lambda b: add_image(b, "")),
        {},
        "messages[0].content[2].image_url.url",
        ["must not be empty"],
    ),
    "path too long": (  # local paths are no image_url form at all
        edit(lambda b: add_image(b, "file:///" + "p" * 60)),
        {},
        "messages[0].content[2].image_url.url",
        ["must be a data: URL or an http(s) URL, got scheme 'file'"],
    ),
    "url too long": (
        edit(lambda b: add_image(b, "http://" + "u" * 60)),
        {},
        "messages[0].content[2].image_url.url",
        ["messages[0].content[2].image_url.url is 67 characters", "limit of 50"],
    ),
    "NUL in path": (
        edit(lambda b: add_image(b, "http://a\x00b")),
        {},
        "messages[0].content[2].image_url.url",
        ["must not contain NUL"],
    ),
    "max_new_tokens above the limit": (
        edit(lambda b: None, max_tokens=501),
        {},
        "max_tokens",
        ["max_tokens must be at most 500, got 501"],
    ),
    "NaN temperature": (
        edit(lambda b: None, temperature=float("nan")),
        {},
        "temperature",
        ["temperature must be a finite number in [0, 100], got nan"],
    ),
    "infinite temperature": (
        edit(lambda b: None, temperature=float("inf")),
        {},
        "temperature",
        ["inf"],
    ),
    "negative temperature": (
        edit(lambda b: None, temperature=-0.5),
        {},
        "temperature",
        ["got -0.5"],
    ),
    "temperature above 100": (
        edit(lambda b: None, temperature=101.0),
        {},
        "temperature",
        ["[0, 100]"],
    ),
    "denormal temperature": (
        edit(lambda b: None, temperature=1e-45),
        {},
        "temperature",
        ["temperature must be 0 (greedy) or in [0.01, 100]", "1.4013e-45"],
    ),
    "NaN top_p": (edit(lambda b: None, top_p=float("nan")), {}, "top_p", ["[0, 1]", "nan"]),
    "top_p above 1": (edit(lambda b: None, top_p=1.5), {}, "top_p", ["got 1.5"]),
    "negative top_p": (edit(lambda b: None, top_p=-0.1), {}, "top_p", ["top_p must be"]),
    "top_k below -1": (
        edit(lambda b: None, top_k=-2),
        {},
        "top_k",
        ["top_k must be in [-1, 1000]", "-2"],
    ),
    "top_k above the limit": (edit(lambda b: None, top_k=1001), {}, "top_k", ["1001"]),
    "top_logprobs above 20": (
        edit(lambda b: None, logprobs=True, top_logprobs=21),
        {},
        "top_logprobs",
        ["top_logprobs must be in [0, 20], got 21"],
    ),
    "frequency_penalty above 2": (
        edit(lambda b: None, frequency_penalty=2.5),
        {},
        "frequency_penalty",
        ["frequency_penalty must be a finite number in [-2, 2], got 2.5"],
    ),
    "NaN presence_penalty": (
        edit(lambda b: None, presence_penalty=float("nan")),
        {},
        "presence_penalty",
        ["[-2, 2]", "nan"],
    ),
    "negative repetition_penalty": (
        edit(lambda b: None, repetition_penalty=-1.0),
        {},
        "repetition_penalty",
        ["repetition_penalty must be a finite number in (0, 10]", "got -1"],
    ),
    "infinite repetition_penalty": (
        edit(lambda b: None, repetition_penalty=1e39),  # inf as a proto float
        {},
        "repetition_penalty",
        ["(0, 10]", "inf"],
    ),
    "min_p above 1": (
        edit(lambda b: None, min_p=1.5),
        {},
        "min_p",
        ["min_p must be a finite number in [0, 1], got 1.5"],
    ),
    "min_tokens above max_new_tokens": (
        edit(lambda b: None, max_tokens=4, min_tokens=5),
        {},
        "min_tokens",
        ["min_tokens must be at most max_tokens (4), got 5"],
    ),
    "min_tokens above the limit": (
        edit(lambda b: None, min_tokens=501),
        {},
        "min_tokens",
        ["min_tokens must be at most 500, got 501"],
    ),
    "too many logit_bias entries": (
        edit(lambda b: None, logit_bias={str(i): 1.0 for i in range(301)}),
        {},
        "logit_bias",
        ["logit_bias has 301 entries", "limit of 300"],
    ),
    "negative logit_bias id": (
        edit(lambda b: None, logit_bias={"5": 1.0, "-3": 1.0}),
        {},
        "logit_bias",
        ["logit_bias token ids must be >= 0, got -3"],
    ),
    "logit_bias value above 100": (
        edit(lambda b: None, logit_bias={"5": 100.5}),
        {},
        "logit_bias",
        ["logit_bias values", "[-100, 100]", "got 100.5 for token 5"],
    ),
    "NaN logit_bias value": (
        edit(lambda b: None, logit_bias={"7": float("nan")}),
        {},
        "logit_bias",
        ["logit_bias values", "[-100, 100]", "got nan for token 7"],
    ),
    "too many stop ids": (
        edit(lambda b: None, stop_token_ids=[1, 2, 3, 4]),
        {},
        "stop_token_ids",
        ["stop_token_ids has 4 entries", "limit of 3"],
    ),
    "negative stop id": (
        edit(lambda b: None, stop_token_ids=[5, -1]),
        {},
        "stop_token_ids[1]",
        ["stop_token_ids[1] must be >= 0, got -1"],
    ),
    "too many stop strings": (
        edit(lambda b: None, stop=["a", "b", "c"]),
        {},
        "stop",
        ["stop has 3 entries", "limit of 2"],
    ),
    "empty stop string": (
        edit(lambda b: None, stop=["a", ""]),
        {},
        "stop[1]",
        ["stop[1] must not be empty"],
    ),
    "long stop string": (
        edit(lambda b: None, stop="123456789"),
        {},
        "stop[0]",
        ["stop[0] is 9 characters", "limit of 8"],
    ),
    "structured output with no kind": (
        edit(lambda b: None, response_format={}),
        {},
        "response_format.type",
        ["response_format.type must be 'text', 'json_object' or 'json_schema', got None"],
    ),
    "json_object false": (
        edit(lambda b: None, structured_outputs={"json_object": 5}),
        {},
        "structured_outputs.json_object",
        ["structured_outputs.json_object", "valid boolean"],
    ),
    "empty grammar": (
        edit(lambda b: None, guided_grammar=""),
        {},
        "guided_grammar",
        ["guided_grammar must be a non-empty string"],
    ),
    "schema not JSON": (
        edit(lambda b: None, guided_json="{nope"),
        {},
        "guided_json",
        ["guided_json is not valid JSON"],
    ),
    "schema a list": (
        edit(lambda b: None, guided_json=[1]),
        {},
        "guided_json",
        ["guided_json must be a JSON schema (an object)"],
    ),
    "schema too long": (
        edit(
            lambda b: None,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"description": "d" * 70000}},
            },
        ),
        {},
        "response_format.json_schema.schema",
        ["response_format.json_schema.schema is 70019 characters", "limit of 65536"],
    ),
    "no choices": (
        edit(lambda b: None, guided_choice=[]),
        {},
        "guided_choice",
        ["guided_choice must be a non-empty list of strings"],
    ),
    "an empty choice": (
        edit(lambda b: None, guided_choice=["a", ""]),
        {},
        "guided_choice[1]",
        ["guided_choice[1] must be a non-empty string"],
    ),
    "long request id": (
        base(),
        {"X-Request-Id": "r" * 17},
        "X-Request-Id",
        ["X-Request-Id must be at most 16 characters", "got 17"],
    ),
    "control character in request id": (
        base(),
        {"X-Request-Id": "a\tb"},
        "X-Request-Id",
        ["X-Request-Id", "printable"],
    ),
}

# What only the HTTP API has: name -> (body or raw bytes, param, words)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[Gateway]:
    yield from limits_gateway(tmp_path_factory.mktemp("refusals"))


@pytest.fixture(scope="module")
def sent() -> dict[str, int]:
    """Chat completions answered so far, by outcome (checked against the gateway's metrics)."""
    return {}


def test_every_grpc_bad_input_has_its_http_case() -> None:
    assert set(CASES) == set(BAD)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_400_naming_the_json_field(gateway, sent, name: str, stream: bool) -> None:
    body, headers, param, words = CASES[name]
    body = copy.deepcopy(body)
    if stream:
        body["stream"] = True
    error = assert_error(post(gateway, body, headers), 400, param, words)
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_argument"
    assert "sampling." not in error["message"] and ".image." not in error["message"]
    sent["INVALID_ARGUMENT"] = sent.get("INVALID_ARGUMENT", 0) + 1


def test_refusals_count_under_their_outcome_with_api_http(gateway, sent) -> None:
    assert counted_refusals(gateway) == {k: float(v) for k, v in sent.items()}
