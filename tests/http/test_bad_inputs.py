"""Every bad input of the gRPC suite, through HTTP: the status and OpenAI's error JSON.

A gateway process with the same request limits as ``tests/gateway/test_validation.py`` (and no
workers: everything here is refused before routing) gets each of that suite's bad requests
written as OpenAI JSON, streamed and not, and must answer 400 with
``{"error": {"message", "type", "param", "code"}}`` whose ``param`` is the request's JSON path
and whose message names the field and its bound. The HTTP-only checks (``n``, part types, image
URL forms, types, sizes, unknown paths) follow, and the refusals must count under their outcome
with ``api="http"``.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from common.procs import ServiceProcess, free_port
from tests.gateway.test_validation import BAD, LIMITS

SERVED = "served-name"
TINY_URL = "data:image/png;base64," + base64.b64encode(b"\x89PNG").decode()
MAX_MESSAGE_MB = 1


def base() -> dict:
    """The JSON twin of ``test_validation.make_request``."""
    return {
        "model": SERVED,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": TINY_URL}},
                    {"type": "text", "text": "Describe it."},
                ],
            }
        ],
    }


def edit(fn: Callable[[dict], object], **fields: object) -> dict:
    body = base()
    body.update(fields)
    fn(body)
    return body


def add_message(body: dict, role: str = "user", content: object = "x") -> None:
    body["messages"].append({"role": role, "content": content})


def add_image(body: dict, url: object) -> None:
    body["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": url}})


def image_part(url: str) -> list:
    return [{"type": "image_url", "image_url": {"url": url}}]


# name (as in test_validation.BAD) -> (body, headers, param, words the message must contain)
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
HTTP_ONLY: dict[str, tuple[dict | bytes, str | None, list[str]]] = {
    "n of 2": (edit(lambda b: None, n=2), "n", ["n must be 1"]),
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
        ["must be 'text' or 'image_url', got 'input_audio'"],
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
    "logprobs": (edit(lambda b: None, logprobs=True), "logprobs", ["not supported"]),
    "tools": (edit(lambda b: None, tools=[{"type": "function"}]), "tools", ["not supported"]),
    "json mode": (
        edit(lambda b: None, response_format={"type": "json_object"}),
        "response_format",
        ["'json_object' is not supported"],
    ),
    "presence penalty": (
        edit(lambda b: None, presence_penalty=0.5),
        "presence_penalty",
        ["not supported"],
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


@dataclasses.dataclass
class Gateway:
    proc: ServiceProcess
    url: str
    metrics_port: int


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[Gateway]:
    """A gateway process with the suite's limits, no workers, metrics on."""
    limits = [
        arg
        for f in dataclasses.fields(LIMITS)
        for arg in (f"--{f.name.replace('_', '-')}", str(getattr(LIMITS, f.name)))
    ]
    port, registry, http_port, metrics = (free_port() for _ in range(4))
    args = ["serve", "gateway", "--port", str(port), "--registry-port", str(registry),
            "--http-port", str(http_port), "--metrics-port", str(metrics),
            "--served-model-name", SERVED, "--default-max-new-tokens", "16",
            "--max-message-mb", str(MAX_MESSAGE_MB), *limits]  # fmt: skip
    log_dir: Path = tmp_path_factory.mktemp("bad-inputs")
    proc = ServiceProcess("gateway", args, f"127.0.0.1:{port}", log_dir)
    try:
        proc.wait_healthy(60)
        yield Gateway(proc, f"http://127.0.0.1:{http_port}", metrics)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def sent() -> dict[str, int]:
    """Chat completions answered so far, by outcome (checked against the gateway's metrics)."""
    return {}


def post(gateway: Gateway, body: dict | bytes, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(
        gateway.url + "/v1/chat/completions", content=content, headers=headers, timeout=30
    )


def assert_error(reply: httpx.Response, status: int, param: str | None, words: list[str]) -> dict:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


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
    timeout = {"X-Request-Timeout": "-1"}
    assert_error(post(gateway, base(), timeout), 400, "X-Request-Timeout", ["positive number"])
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
    text = httpx.get(f"http://127.0.0.1:{gateway.metrics_port}/metrics").text
    counted = {}
    for line in text.splitlines():
        if line.startswith("epd_gateway_requests_total{"):
            labels, value = line[len("epd_gateway_requests_total{") :].split("} ")
            pairs = dict(item.replace('"', "").split("=") for item in labels.split(","))
            assert pairs["api"] == "http", line
            counted[pairs["outcome"]] = float(value)
    assert counted == {k: float(v) for k, v in sent.items()}
