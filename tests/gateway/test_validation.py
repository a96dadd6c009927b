"""Request validation: a table of bad requests, each INVALID_ARGUMENT naming its field and bound,
and the edge values that must pass. Pure function, no server."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import grpc
import pytest

from protos.epd.v1 import common_pb2, gateway_pb2
from services.gateway.config import REQUEST_LIMIT_FIELDS, GatewayConfig
from services.gateway.errors import GatewayError
from services.gateway.validation import RequestLimits, validate_request

LIMITS = RequestLimits(
    max_messages=4,
    max_parts_per_message=3,
    max_text_chars=100,
    max_images=2,
    max_image_bytes=1000,
    max_image_ref_chars=50,
    max_stop=2,
    max_stop_chars=8,
    max_stop_token_ids=3,
    max_top_k=1000,
    max_new_tokens_limit=500,
    max_request_id_chars=16,
)


def make_request(**sampling: object) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        messages=[
            common_pb2.ChatMessage(
                role="user",
                content=[
                    common_pb2.ContentPart(image=common_pb2.ImageSource(data=b"\x89PNG")),
                    common_pb2.ContentPart(text="Describe it."),
                ],
            )
        ],
        sampling=common_pb2.SamplingParams(**sampling),
    )


def edit(fn: Callable[[gateway_pb2.GenerateRequest], object], **sampling: object):
    request = make_request(**sampling)
    fn(request)
    return request


def add_message(request, role="user", text="x") -> None:
    request.messages.add(role=role).content.add(text=text)


def add_message_with_image(request, **source) -> None:
    request.messages.add(role="user").content.add(image=common_pb2.ImageSource(**source))


def add_image(request, **source) -> None:
    request.messages[0].content.add(image=common_pb2.ImageSource(**source))


# name -> (request, words the message must contain: the field path and the bound)
BAD = {
    "no messages": (gateway_pb2.GenerateRequest(), ["messages must not be empty"]),
    "too many messages": (
        edit(lambda r: [add_message(r) for _ in range(4)]),
        ["messages has 5 entries", "limit of 4"],
    ),
    "bad role": (
        edit(lambda r: setattr(r.messages[0], "role", "robot")),
        ["messages[0].role", "system, user, assistant", "'robot'"],
    ),
    "empty role": (edit(lambda r: add_message(r, role="")), ["messages[1].role", "''"]),
    "message without content": (
        edit(lambda r: r.messages.add(role="user")),
        ["messages[1].content must not be empty"],
    ),
    "too many parts": (
        edit(lambda r: [r.messages[0].content.add(text="a") for _ in range(2)]),
        ["messages[0].content has 4 parts", "limit of 3"],
    ),
    "empty part": (
        edit(lambda r: r.messages[0].content.add()),
        ["messages[0].content[2] is empty"],
    ),
    "too much text": (
        edit(lambda r: add_message(r, text="y" * 90)),
        ["messages[1].content[0].text", "102 characters", "limit of 100"],
    ),
    "too many images": (
        edit(lambda r: [add_message_with_image(r, url="u") for _ in range(2)]),
        ["messages[2].content[0].image is image 3", "limit of 2 images"],
    ),
    "image without source": (
        edit(lambda r: r.messages[0].content.add().image.SetInParent()),
        ["messages[0].content[2].image has no source"],
    ),
    "empty image data": (
        edit(lambda r: add_image(r, data=b"")),
        ["messages[0].content[2].image.data is empty"],
    ),
    "image too large": (
        edit(lambda r: setattr(r.messages[0].content[0].image, "data", b"x" * 1001)),
        ["messages[0].content[0].image.data", "1001 bytes", "limit of 1000 bytes"],
    ),
    "base64 too long": (
        edit(lambda r: add_image(r, base64="A" * 5000)),
        ["messages[0].content[2].image.base64", "5000 characters", "limit of"],
    ),
    "empty base64": (
        edit(lambda r: add_image(r, base64="")),
        ["messages[0].content[2].image.base64 is empty"],
    ),
    "path too long": (
        edit(lambda r: add_image(r, path="/" + "p" * 60)),
        ["messages[0].content[2].image.path", "61 characters", "limit of 50"],
    ),
    "url too long": (
        edit(lambda r: add_image(r, url="http://" + "u" * 60)),
        ["messages[0].content[2].image.url", "limit of 50"],
    ),
    "NUL in path": (
        edit(lambda r: add_image(r, path="/tmp/a\x00b")),
        ["messages[0].content[2].image.path", "NUL"],
    ),
    "max_new_tokens above the limit": (
        make_request(max_new_tokens=501),
        ["sampling.max_new_tokens", "at most 500", "got 501"],
    ),
    "NaN temperature": (
        make_request(temperature=float("nan")),
        ["sampling.temperature must be a finite number in [0, 100], got nan"],
    ),
    "infinite temperature": (make_request(temperature=float("inf")), ["temperature", "inf"]),
    "negative temperature": (make_request(temperature=-0.5), ["temperature", "got -0.5"]),
    "temperature above 100": (make_request(temperature=101.0), ["temperature", "[0, 100]"]),
    "denormal temperature": (
        make_request(temperature=1e-45),
        ["sampling.temperature must be 0 (greedy) or in [0.01, 100]", "1.4013e-45"],
    ),
    "NaN top_p": (make_request(top_p=float("nan")), ["sampling.top_p", "[0, 1]", "nan"]),
    "top_p above 1": (make_request(top_p=1.5), ["sampling.top_p", "got 1.5"]),
    "negative top_p": (make_request(top_p=-0.1), ["sampling.top_p"]),
    "top_k below -1": (make_request(top_k=-2), ["sampling.top_k must be in [-1, 1000]", "-2"]),
    "top_k above the limit": (make_request(top_k=1001), ["sampling.top_k", "1001"]),
    "structured output with no kind": (
        make_request(structured_output=common_pb2.StructuredOutput()),
        ["sampling.structured_output must set one of json_schema"],
    ),
    "json_object false": (
        make_request(structured_output=common_pb2.StructuredOutput(json_object=False)),
        ["sampling.structured_output.json_object must be true when set"],
    ),
    "empty grammar": (
        make_request(structured_output=common_pb2.StructuredOutput(grammar="")),
        ["sampling.structured_output.grammar must not be empty"],
    ),
    "schema not JSON": (
        make_request(structured_output=common_pb2.StructuredOutput(json_schema="{nope")),
        ["sampling.structured_output.json_schema is not valid JSON"],
    ),
    "schema a list": (
        make_request(structured_output=common_pb2.StructuredOutput(json_schema="[1]")),
        ["sampling.structured_output.json_schema must be a JSON schema (an object), got list"],
    ),
    "schema too long": (
        make_request(
            structured_output=common_pb2.StructuredOutput(json_schema='"' + "a" * 70000 + '"')
        ),
        ["sampling.structured_output.json_schema is 70002 characters", "limit of 65536"],
    ),
    "no choices": (
        make_request(
            structured_output=common_pb2.StructuredOutput(choice=common_pb2.StringChoice())
        ),
        ["sampling.structured_output.choice must list 1 to 256 strings, got 0"],
    ),
    "an empty choice": (
        make_request(
            structured_output=common_pb2.StructuredOutput(
                choice=common_pb2.StringChoice(choices=["a", ""])
            )
        ),
        ["sampling.structured_output.choice.choices[1] must not be empty"],
    ),
    "top_logprobs above 20": (
        make_request(top_logprobs=21),
        ["sampling.top_logprobs must be in [0, 20]", "21"],
    ),
    "frequency_penalty above 2": (
        make_request(frequency_penalty=2.5),
        ["sampling.frequency_penalty must be a finite number in [-2, 2], got 2.5"],
    ),
    "NaN presence_penalty": (
        make_request(presence_penalty=float("nan")),
        ["sampling.presence_penalty", "[-2, 2]", "nan"],
    ),
    "negative repetition_penalty": (
        make_request(repetition_penalty=-1.0),
        ["sampling.repetition_penalty must be a finite number in (0, 10]", "got -1"],
    ),
    "infinite repetition_penalty": (
        make_request(repetition_penalty=float("inf")),
        ["sampling.repetition_penalty", "(0, 10]", "inf"],
    ),
    "min_p above 1": (
        make_request(min_p=1.5),
        ["sampling.min_p must be a finite number in [0, 1], got 1.5"],
    ),
    "min_tokens above max_new_tokens": (
        make_request(max_new_tokens=4, min_tokens=5),
        ["sampling.min_tokens must be at most max_new_tokens (4), got 5"],
    ),
    "min_tokens above the limit": (
        make_request(min_tokens=501),
        ["sampling.min_tokens must be at most 500, got 501"],
    ),
    "too many logit_bias entries": (
        make_request(logit_bias={i: 1.0 for i in range(301)}),
        ["sampling.logit_bias has 301 entries", "limit of 300"],
    ),
    "negative logit_bias id": (
        make_request(logit_bias={5: 1.0, -3: 1.0}),
        ["sampling.logit_bias token ids must be >= 0, got -3"],
    ),
    "logit_bias value above 100": (
        make_request(logit_bias={5: 100.5}),
        ["sampling.logit_bias values", "[-100, 100]", "got 100.5 for token 5"],
    ),
    "NaN logit_bias value": (
        make_request(logit_bias={7: float("nan")}),
        ["sampling.logit_bias values", "[-100, 100]", "got nan for token 7"],
    ),
    "too many stop ids": (
        make_request(stop_token_ids=[1, 2, 3, 4]),
        ["sampling.stop_token_ids has 4 entries", "limit of 3"],
    ),
    "negative stop id": (
        make_request(stop_token_ids=[5, -1]),
        ["sampling.stop_token_ids[1] must be >= 0, got -1"],
    ),
    "too many stop strings": (
        make_request(stop=["a", "b", "c"]),
        ["sampling.stop has 3 entries", "limit of 2"],
    ),
    "empty stop string": (make_request(stop=["a", ""]), ["sampling.stop[1] must not be empty"]),
    "long stop string": (
        make_request(stop=["123456789"]),
        ["sampling.stop[0] is 9 characters", "limit of 8"],
    ),
    "long request id": (
        edit(lambda r: setattr(r, "request_id", "r" * 17)),
        ["request_id", "at most 16", "got 17"],
    ),
    "control character in request id": (
        edit(lambda r: setattr(r, "request_id", "a\nb")),
        ["request_id", "printable"],
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_request_is_invalid_argument_naming_the_field(name: str) -> None:
    request, words = BAD[name]
    with pytest.raises(GatewayError) as info:
        validate_request(request, LIMITS)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    for word in words:
        assert word in info.value.message, (name, info.value.message)


def test_edge_values_pass() -> None:
    request = make_request(
        max_new_tokens=500,
        temperature=100.0,
        top_p=1.0,
        top_k=1000,
        seed=2**64 - 1,
        stop=["12345678", "x"],
        stop_token_ids=[0, 1, 2**31 - 1],
    )
    add_image(request, path="/" + "p" * 49)
    request.messages[0].content[0].image.data = b"x" * 1000
    request.messages[0].content[1].text = "t" * 98
    request.messages.add(role="assistant").content.add(text="ok")
    request.messages.add(role="system").content.add(text="")  # empty text is allowed
    request.messages.add(role="user").content.add(image=common_pb2.ImageSource(url="http://x"))
    with pytest.raises(GatewayError, match="limit of 2 images"):
        validate_request(request, LIMITS)  # the third image is one too many
    del request.messages[3]
    request.request_id = "r" * 16
    validate_request(request, LIMITS)
    for temperature in (0.0, 0.01, 1.0):
        for top_p, top_k in ((0.0, 0), (0.5, -1)):
            validate_request(
                make_request(temperature=temperature, top_p=top_p, top_k=top_k), LIMITS
            )
    for low, high in ((-2.0, 2.0), (2.0, -2.0)):
        validate_request(make_request(frequency_penalty=low, presence_penalty=high), LIMITS)
    for repetition_penalty in (0.0, 1e-3, 1.0, 10.0):  # 0 = unset = off
        validate_request(make_request(repetition_penalty=repetition_penalty), LIMITS)
    bias = {i: -100.0 if i % 2 else 100.0 for i in range(300)}
    bias[2**31 - 1] = bias.pop(0)  # any id: the worker checks its vocabulary
    edges = dict(logit_bias=bias, min_p=1.0, min_tokens=500, max_new_tokens=500)
    validate_request(make_request(**edges), LIMITS)
    validate_request(make_request(min_tokens=500), LIMITS)  # max_new_tokens is the default


def test_base64_bound_is_the_base64_of_the_byte_bound() -> None:
    import base64

    data = b"\xff" * LIMITS.max_image_bytes
    encoded = "data:image/png;base64," + base64.encodebytes(data).decode()  # MIME line breaks
    request = edit(lambda r: add_image(r, base64=encoded))
    validate_request(request, LIMITS)
    assert LIMITS.max_base64_chars < 2 * LIMITS.max_image_bytes


def test_limits_mirror_the_config_block() -> None:
    assert {f.name for f in dataclasses.fields(RequestLimits)} == set(REQUEST_LIMIT_FIELDS)
    config = GatewayConfig(max_images=3, max_new_tokens_limit=64, default_max_new_tokens=32)
    limits = RequestLimits.from_config(config)
    assert limits.max_images == 3 and limits.max_new_tokens_limit == 64
    assert RequestLimits.from_config(GatewayConfig()) == RequestLimits()  # same defaults


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"max_images": 0}, "max_images must be positive"),
        ({"max_text_chars": -1}, "max_text_chars must be positive"),
        ({"default_max_new_tokens": 600, "max_new_tokens_limit": 500}, "max_new_tokens_limit"),
    ],
)
def test_config_refuses_bad_limits(overrides: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        GatewayConfig(**overrides)


def raw_prompt(**fields: object) -> gateway_pb2.GenerateRequest:
    sampling = fields.pop("sampling", None)
    return gateway_pb2.GenerateRequest(sampling=sampling, **fields)


# A raw prompt (text or token ids) instead of messages: name -> (request, words).
BAD_RAW = {
    "messages and prompt_text": (
        edit(lambda r: setattr(r, "prompt_text", "hi")),
        ["exactly one of messages, prompt_text, prompt_token_ids"],
    ),
    "prompt_text and ids": (
        raw_prompt(prompt_text="hi", prompt_token_ids=[1]),
        ["exactly one of messages, prompt_text, prompt_token_ids"],
    ),
    "long prompt_text": (
        raw_prompt(prompt_text="x" * 101),
        ["prompt_text is 101 characters", "limit of 100"],
    ),
    "too many prompt ids": (
        raw_prompt(prompt_token_ids=[1] * 101),
        ["prompt_token_ids has 101 entries", "limit of 100"],
    ),
    "negative prompt id": (
        raw_prompt(prompt_token_ids=[1, -3]),
        ["prompt_token_ids[1] must be >= 0, got -3"],
    ),
    "prompt_logprobs above 20": (
        raw_prompt(prompt_text="hi", sampling=common_pb2.SamplingParams(prompt_logprobs=21)),
        ["sampling.prompt_logprobs must be in [0, 20], got 21"],
    ),
    "prompt_logprobs with an image": (
        make_request(prompt_logprobs=0),
        ["sampling.prompt_logprobs is for text-only prompts"],
    ),
    "echo of messages": (
        edit(lambda r: setattr(r, "echo", True)),
        ["echo needs a raw prompt"],
    ),
}


@pytest.mark.parametrize("name", list(BAD_RAW))
def test_bad_raw_prompt_is_invalid_argument_naming_its_field(name: str) -> None:
    request, words = BAD_RAW[name]
    with pytest.raises(GatewayError) as info:
        validate_request(request, LIMITS)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    for word in words:
        assert word in info.value.message


def test_raw_prompts_at_their_bounds_pass() -> None:
    validate_request(raw_prompt(prompt_text="x" * 100, echo=True), LIMITS)
    validate_request(raw_prompt(prompt_token_ids=[0] * 100, echo=True), LIMITS)
    sampling = common_pb2.SamplingParams(prompt_logprobs=20)
    validate_request(raw_prompt(prompt_text="x", sampling=sampling), LIMITS)
