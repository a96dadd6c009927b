"""Tools through the whole stack with the official ``openai`` client (and gRPC): a forced call
(``required``, a named function) comes back as OpenAI ``tool_calls`` whose arguments follow the
function's schema, streamed as deltas too; a conversation with calls and their results is
served; ``auto`` answers; bad tools are 400s naming the field."""

from __future__ import annotations

import json
import uuid

import jsonschema
import openai
import pytest

from protos.epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.http.conftest import image_message

PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": PARAMETERS},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
                                                                          "properties": {}}}},
]  # fmt: skip


def _messages(text: str = "Weather in Paris?") -> list[dict]:
    return [{"role": "user", "content": f"{text} {uuid.uuid4().hex[:8]}"}]


def _check_weather(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS)


def test_a_named_function_is_called(client, model) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model=model, messages=_messages(), tools=TOOLS, tool_choice=choice, max_tokens=128
    )
    answer = reply.choices[0]
    assert answer.finish_reason == "tool_calls", answer
    assert answer.message.content is None
    assert len(answer.message.tool_calls) == 1
    _check_weather(answer.message.tool_calls[0])


def test_required_streams_its_calls_as_deltas(client, model) -> None:
    """One or more calls, then the end (seeded and with a fixed prompt: the same draw each
    run, which ends after its calls well within the budget)."""
    messages = [{"role": "user", "content": "Weather and time in Paris?"}]
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=400,
        temperature=0.7, seed=3, stream=True,
    )  # fmt: skip
    calls, finish, content = [], None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [c.index for c in calls] == list(range(len(calls))) and calls
    for call in calls:
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            _check_weather(call)


def test_a_conversation_with_calls_and_results(client, model) -> None:
    """The call and its result go back in; an image in the user turn takes the encoder path."""
    messages = [
        image_message(f"Where is this, and the weather there? {uuid.uuid4().hex[:6]}"),
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22 C"},
    ]  # fmt: skip
    reply = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=8
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > 100  # the tools, the call and the result are in it


def test_grpc_clients_get_the_calls(http_stack) -> None:
    request = gateway_pb2.GenerateRequest(
        messages=[common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="Hi")])],
        sampling=common_pb2.SamplingParams(max_new_tokens=128),
        tools=[common_pb2.Tool(name="get_weather", parameters=json.dumps(PARAMETERS))],
        tool_choice=common_pb2.ToolChoice(function="get_weather"),
    )
    with http_stack.channel() as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).GenerateUnary(request, timeout=120)
    assert reply.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS, reply
    assert reply.tool_calls and reply.tool_calls[0].name == "get_weather"
    jsonschema.validate(json.loads(reply.tool_calls[0].arguments), PARAMETERS)


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
         "tools[0].function.name", "must be 1 to 64"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]", "of type 'function'"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be one of"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "is not one of tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "cannot be combined with a tool_choice"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(client, model, kwargs, param, words) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=_messages(), max_tokens=4, **kwargs)
    assert info.value.body["param"] == param, info.value.body
    assert words in info.value.body["message"], info.value.body
