"""The HTTP layer's pure translations, without a server: gRPC field paths into JSON paths,
chunks into OpenAI's objects and events (checked against the published models), gRPC statuses
into HTTP ones, and the status page's percentile."""

from __future__ import annotations

import json

import grpc
import pytest

from protos.epd.v1 import common_pb2, gateway_pb2
from services.gateway.errors import GatewayError
from services.gateway.http import schemas
from services.gateway.http.convert import FieldNames, to_generate_request
from services.gateway.http.dashboard import percentile, worker_id
from services.gateway.http.errors import STATUS, from_gateway
from services.gateway.http.replies import ChunkWriter, Head, completion, event
from services.gateway.validation import RequestLimits


@pytest.mark.parametrize(
    "message, param, rewritten",
    [
        ("sampling.temperature must be x", "temperature", "temperature must be x"),
        ("sampling.max_new_tokens must be at most 5 (0 = the server default), got 6",
         "max_completion_tokens", "max_completion_tokens must be at most 5, got 6"),
        ("sampling.stop[1] must not be empty", "stop[1]", "stop[1] must not be empty"),
        ("sampling.logit_bias token ids must be in [0, 400), got 400", "logit_bias",
         "logit_bias token ids must be in [0, 400), got 400"),
        ("sampling.min_p must be x", "min_p", "min_p must be x"),
        ("messages[0].content[1].image.base64 is 9 characters",
         "messages[0].content[1].image_url.url",
         "messages[0].content[1].image_url.url is 9 characters"),
        ("messages[0].content[2].video.sampling.fps must be in [0, 1000]",
         "messages[0].content[2].video_url.fps",
         "messages[0].content[2].video_url.fps must be in [0, 1000]"),
        ("messages[0].content[2].video.source.base64 is 9 characters",
         "messages[0].content[2].video_url.url",
         "messages[0].content[2].video_url.url is 9 characters"),
        ("messages[2].content[0].image is image 3", "messages[2].content[0].image_url",
         "messages[2].content[0].image_url is image 3"),
        ("messages[1].content[0].text brings the text to", "messages[1].content",
         "messages[1].content brings the text to"),
        ("messages[0].content[0].text brings the text to", "messages[0].content[0].text",
         "messages[0].content[0].text brings the text to"),
        ("messages[3].role must be", "messages[3].role", "messages[3].role must be"),
        ("messages has 5 entries", "messages", "messages has 5 entries"),
        ("request_id must be printable", "X-Request-Id", "X-Request-Id must be printable"),
        ("image 0: not an image", None, "image 0: not an image"),
    ],
)  # fmt: skip
def test_field_paths_become_json_paths(message: str, param: str | None, rewritten: str) -> None:
    names = FieldNames(max_tokens_name="max_completion_tokens", string_contents={1})
    assert names.rewrite(message) == (rewritten, param)


def test_body_becomes_the_same_proto_a_grpc_client_sends() -> None:
    body = schemas.ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
                        {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                        {"type": "text", "text": "What?"},
                    ],
                },
            ],
            "max_tokens": 7,
            "seed": -1,
            "stop": "END",
            "top_k": 5,
            "ignore_eos": True,
            "stop_token_ids": [3],
            "frequency_penalty": 0.5,
            "presence_penalty": -0.25,
            "logit_bias": {"12": 3.5, "0": -100},
            "repetition_penalty": 1.25,
            "min_p": 0.125,
            "min_tokens": 2,
            "user": "ignored",
        }
    )
    request, names = to_generate_request(body, "rid", RequestLimits())
    expected = gateway_pb2.GenerateRequest(
        request_id="rid",
        messages=[
            common_pb2.ChatMessage(
                role="system", content=[common_pb2.ContentPart(text="Be brief.")]
            ),
            common_pb2.ChatMessage(
                role="user",
                content=[
                    common_pb2.ContentPart(
                        image=common_pb2.ImageSource(base64="data:image/png;base64,QUJD")
                    ),
                    common_pb2.ContentPart(image=common_pb2.ImageSource(url="https://x/y.png")),
                    common_pb2.ContentPart(text="What?"),
                ],
            ),
        ],
        sampling=common_pb2.SamplingParams(
            max_new_tokens=7,
            temperature=1.0,
            top_p=1.0,
            top_k=5,
            seed=(1 << 64) - 1,
            stop=["END"],
            stop_token_ids=[3],
            ignore_eos=True,
            frequency_penalty=0.5,
            presence_penalty=-0.25,
            repetition_penalty=1.25,
            logit_bias={12: 3.5, 0: -100.0},
            min_p=0.125,
            min_tokens=2,
        ),  # fmt: skip
    )
    assert request == expected
    assert names.string_contents == {0} and names.max_tokens_name == "max_tokens"


def final_chunk() -> gateway_pb2.GenerateChunk:
    return gateway_pb2.GenerateChunk(
        text="!",
        token_ids=[9],
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=gateway_pb2.Usage(prompt_tokens=10, cached_tokens=4, completion_tokens=3),
    )


def test_events_are_openai_chunks_and_skip_empty_deltas() -> None:
    head = Head("chatcmpl-x", 123, "m")
    chunks = [gateway_pb2.GenerateChunk(text="He", token_ids=[1]),
              gateway_pb2.GenerateChunk(text="", token_ids=[2]), final_chunk()]  # fmt: skip
    for include_usage in (False, True):
        writer = ChunkWriter(head, include_usage)
        raw = b"".join(writer.write(c) for c in chunks)
        events = [json.loads(e[len(b"data: ") :]) for e in raw.split(b"\n\n") if e]
        for e in events:
            schemas.ChatCompletionChunk.model_validate(e)
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        assert deltas == [{"role": "assistant", "content": ""}, {"content": "He"},
                          {"content": "!"}, {}]  # fmt: skip
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
        if include_usage:
            assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 13
            assert all(e["usage"] is None for e in events[:-1])
        else:
            assert all("usage" not in e for e in events)


def test_completion_matches_its_model() -> None:
    obj = completion(Head("chatcmpl-x", 1, "m"), "He!", final_chunk())
    parsed = schemas.ChatCompletion.model_validate(obj)
    assert parsed.choices[0].message.content == "He!"
    assert parsed.choices[0].finish_reason == "length"
    assert obj["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}


def test_status_mapping() -> None:
    want = {
        grpc.StatusCode.INVALID_ARGUMENT: 400,
        grpc.StatusCode.UNAUTHENTICATED: 401,
        grpc.StatusCode.NOT_FOUND: 404,
        grpc.StatusCode.ALREADY_EXISTS: 409,
        grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
        grpc.StatusCode.UNAVAILABLE: 503,
        grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    }
    assert {code: STATUS[code][0] for code in want} == want
    error = from_gateway(GatewayError(grpc.StatusCode.INTERNAL, "boom"))
    assert (error.status, error.type, error.code) == (500, "server_error", "internal")
    error = from_gateway(GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"))
    assert error.headers() == {"retry-after": "1"} and error.body()["error"]["message"] == "full"


def test_percentile_and_worker_names() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 0.99) == 99.0
    assert worker_id("10.0.0.1:5", "encoder") == worker_id("10.0.0.1:5", "encoder")
    assert worker_id("10.0.0.1:5", "encoder") != worker_id("10.0.0.2:5", "encoder")
    assert "10.0.0.1" not in worker_id("10.0.0.1:5", "encoder")


def test_an_event_stays_one_line_whatever_the_text_holds():
    text = "a\u2028b\x85c\u2029d\u00e9\n\r\x1ce"  # what str.splitlines takes for line breaks
    raw = event({"content": text})
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    lines = raw.decode().splitlines()
    assert lines[1:] == [""]  # one line for any splitter, then the blank line that ends it
    assert json.loads(lines[0][len("data: ") :]) == {"content": text}


def logprob(token: str, value: float) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token=token, logprob=value, token_bytes=token.encode())


def test_streamed_logprobs_wait_for_text_and_the_finish_carries_the_rest() -> None:
    """A chunk whose text the worker held back (a possible stop string) has tokens but no text:
    its entries go out with the next text delta; entries of tokens whose text a stop string cut
    go out with the finish delta. Every entry goes out once, in order."""
    head = Head("chatcmpl-x", 1, "m")
    chunks = [
        gateway_pb2.GenerateChunk(text="", token_ids=[1], logprobs=[logprob("E", -0.1)]),
        gateway_pb2.GenerateChunk(text="En", token_ids=[2], logprobs=[logprob("n", -0.2)]),
        gateway_pb2.GenerateChunk(
            text="",
            token_ids=[3],
            logprobs=[logprob("END", -0.3)],
            finish_reason=common_pb2.FINISH_REASON_STOP,
        ),
    ]
    writer = ChunkWriter(head, include_usage=False, logprobs=True)
    raw = b"".join(writer.write(c) for c in chunks)
    events = [json.loads(e[len(b"data: ") :]) for e in raw.split(b"\n\n") if e]
    for e in events:
        schemas.ChatCompletionChunk.model_validate(e)
    shown = [
        ([x["token"] for x in c["logprobs"]["content"]] if c["logprobs"] else None, c["delta"])
        for c in (e["choices"][0] for e in events)
    ]
    assert shown == [
        (None, {"role": "assistant", "content": ""}),
        (["E", "n"], {"content": "En"}),
        (["END"], {}),
    ]
    obj = ChunkWriter(head, False, logprobs=True).unary(chunks)
    schemas.ChatCompletion.model_validate(obj)
    assert [x["token"] for x in obj["choices"][0]["logprobs"]["content"]] == ["E", "n", "END"]
    assert obj["choices"][0]["logprobs"]["refusal"] is None
    assert ChunkWriter(head, False).unary(chunks)["choices"][0]["logprobs"] is None


def test_completion_body_to_proto() -> None:
    from services.gateway.http.completions import to_completion_requests

    body = schemas.CompletionRequest(prompt=[[5, 6]], echo=True, logprobs=2, prompt_logprobs=1)
    [request], names, ask = to_completion_requests(body, "r1", RequestLimits())
    assert request.request_id == "r1"
    assert list(request.prompt_token_ids) == [5, 6] and request.echo
    s = request.sampling
    assert (s.max_new_tokens, s.logprobs, s.top_logprobs, s.prompt_logprobs) == (16, True, 2, 2)
    assert (ask.echo, ask.logprobs, ask.prompt_logprobs) == (True, 2, 1)
    assert names.rewrite("sampling.top_logprobs must be x") == ("logprobs must be x", "logprobs")
    assert names.rewrite("prompt_text is 9 characters") == ("prompt is 9 characters", "prompt")
    assert names.rewrite("prompt_token_ids[3] must be >= 0") == (
        "prompt[3] must be >= 0",
        "prompt[3]",
    )
    [request], _, ask = to_completion_requests(
        schemas.CompletionRequest(prompt="Hi", max_tokens=3), "", RequestLimits()
    )
    assert request.prompt_text == "Hi" and request.sampling.max_new_tokens == 3
    assert not request.sampling.HasField("prompt_logprobs") and ask.logprobs is None

    several, _, _ = to_completion_requests(
        schemas.CompletionRequest(prompt=["a", [7, 8]]), "R", RequestLimits()
    )
    assert [(r.request_id, r.prompt_text, list(r.prompt_token_ids)) for r in several] == [
        ("R-0", "a", []),
        ("R-1", "", [7, 8]),
    ]
    drawn, _, _ = to_completion_requests(
        schemas.CompletionRequest(prompt=["a", "b"]), "", RequestLimits()
    )
    base = drawn[0].request_id[: -len("-0")]
    assert base and [r.request_id for r in drawn] == [f"{base}-0", f"{base}-1"]
