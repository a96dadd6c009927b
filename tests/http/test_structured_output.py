"""Structured output through the whole stack, with the official ``openai`` client (and gRPC):
OpenAI's ``response_format`` (json_schema, json_object), vLLM's ``structured_outputs`` and
``guided_*`` extensions; answers are in the language asked for, streamed or not, with an image
too; what cannot be served is a 400 naming the field."""

from __future__ import annotations

import json
import re
import uuid

import jsonschema
import openai
import pytest

from protos.epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.http.conftest import image_message

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "size", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
}
REGEX = r"[0-9]{3}-[a-z]{2}"


def _ask(client, model, content="Describe a thing.", **kw):
    messages = [{"role": "user", "content": f"{content} {uuid.uuid4().hex[:8]}"}]
    return client.chat.completions.create(model=model, messages=messages, max_tokens=64, **kw)


def test_json_schema_streamed_and_not(client, model) -> None:
    reply = _ask(client, model, temperature=0, response_format=RESPONSE_FORMAT)
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    stream = _ask(client, model, temperature=0.8, seed=7, response_format=RESPONSE_FORMAT,
                  stream=True)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_vllm_extensions(client, model) -> None:
    choices = ["alpha", "beta gamma", "δέλτα"]
    reply = _ask(client, model, extra_body={"structured_outputs": {"choice": choices}})
    assert reply.choices[0].message.content in choices
    reply = _ask(client, model, temperature=0, extra_body={"guided_regex": REGEX})
    assert re.fullmatch(REGEX, reply.choices[0].message.content)
    grammar = 'root ::= "on" | "off" | "n/a"'
    reply = _ask(client, model, extra_body={"structured_outputs": {"grammar": grammar}})
    assert reply.choices[0].message.content in ("on", "off", "n/a")
    reply = _ask(client, model, extra_body={"guided_json": json.dumps(SCHEMA)})
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)


def test_json_object_with_an_image(client, model) -> None:
    """An image request (encoder, transfer) with a structured answer."""
    reply = client.chat.completions.create(
        model=model,
        messages=[image_message(f"What is it? {uuid.uuid4().hex[:8]}")],
        max_tokens=8,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].message.content.startswith("{")  # random weights: the first tokens


def test_grpc_clients_ask_the_same_way(http_stack) -> None:
    request = gateway_pb2.GenerateRequest(
        messages=[common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="Hi")])],
        sampling=common_pb2.SamplingParams(
            max_new_tokens=32, structured_output=common_pb2.StructuredOutput(regex=REGEX)
        ),
    )
    with http_stack.channel() as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).GenerateUnary(request, timeout=120)
    assert re.fullmatch(REGEX, reply.text), reply.text


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format.json_schema.schema",
            "is not usable",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "is required"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex", "is not usable"),
        ({"extra_body": {"structured_outputs": {"grammar": "start: {{"}}},
         "structured_outputs.grammar", "is not usable"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice", "non-empty list"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
         "guided_regex", "only one structured output"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(client, model, kwargs, param, words) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, model, **kwargs)
    assert info.value.body["param"] == param, info.value.body
    assert words in info.value.body["message"], info.value.body
