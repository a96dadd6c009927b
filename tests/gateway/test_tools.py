"""Tools at the gateway: the Qwen-format prompt, the grammar a forced choice sets, the parser
that splits an answer's text into content and calls (fed in every possible split), and the
validation of tools, choices and tool turns."""

from __future__ import annotations

import json

import grpc
import llguidance
import pytest

from protos.epd.v1 import common_pb2, gateway_pb2
from services.gateway.errors import GatewayError
from services.gateway.orchestrator import with_tools
from services.gateway.tools import ToolCallParser, parse_tool_calls, prompt_messages, tool_grammar
from services.gateway.validation import RequestLimits, validate_request

WEATHER = common_pb2.Tool(
    name="get_weather",
    description="Weather in a city",
    parameters=json.dumps(
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    ),
)
TIME = common_pb2.Tool(name="get_time", parameters="")


def _message(role: str, text: str = "", **kw) -> common_pb2.ChatMessage:
    message = common_pb2.ChatMessage(role=role, **kw)
    if text:
        message.content.add(text=text)
    return message


def _request(*messages, tools=(WEATHER, TIME), choice=None) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(messages=messages or [_message("user", "Hi")])
    request.tools.extend(tools)
    if choice is not None:
        request.tool_choice.CopyFrom(choice)
    return request


def _texts(message: common_pb2.ChatMessage) -> str:
    return "".join(p.text for p in message.content)


def test_prompt_lists_the_tools_in_the_system_turn() -> None:
    out = prompt_messages(_request(_message("user", "Weather in Paris?")))
    assert [m.role for m in out] == ["system", "user"]
    system = _texts(out[0])
    assert system.startswith("You are a helpful assistant.\n\n# Tools")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in listed] == ["get_weather", "get_time"]
    assert json.loads(listed[0])["function"]["parameters"]["required"] == ["city"]
    own = prompt_messages(_request(_message("system", "Be brief."), _message("user", "Hi")))
    assert _texts(own[0]).startswith("Be brief.\n\n# Tools")


def test_calls_and_results_become_qwen_turns() -> None:
    call = common_pb2.ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}')
    out = prompt_messages(
        _request(
            _message("user", "Weather?"),
            _message("assistant", tool_calls=[call]),
            _message("tool", "sunny", tool_call_id="c1"),
            _message("tool", "22C", tool_call_id="c2"),
            _message("user", "Thanks"),
        )
    )
    assert [m.role for m in out] == ["system", "user", "assistant", "user", "user"]
    assert _texts(out[2]) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert _texts(out[3]) == (
        "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22C\n</tool_response>"
    )
    none = _request(_message("user", "Hi"), choice=common_pb2.ToolChoice(mode="none"))
    assert [m.role for m in prompt_messages(none)] == ["user"]  # "none": no tools in the prompt
    plain = gateway_pb2.GenerateRequest(messages=[_message("user", "Hi")])
    assert with_tools(plain) is plain
    asked = _request(_message("user", "Hi"))
    asked.request_id, asked.sampling.max_new_tokens = "r-1", 7
    rendered = with_tools(asked)
    assert [m.role for m in rendered.messages] == ["system", "user"]
    assert rendered.request_id == "r-1" and rendered.sampling.max_new_tokens == 7
    assert list(rendered.tools) == list(asked.tools)  # only the messages are rewritten


@pytest.mark.parametrize(
    "text",
    [
        "Let me check.<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    ],
)
def test_parser_gives_the_same_calls_for_every_split(text: str) -> None:
    for cut in range(len(text) + 1):
        for cut2 in range(cut, len(text) + 1, 7):
            parser = ToolCallParser()
            pieces = [text[:cut], text[cut:cut2], text[cut2:]]
            content, calls = "", []
            for i, piece in enumerate(pieces):
                c, found = parser.feed(piece, final=i == len(pieces) - 1)
                content += c
                calls += found
            assert content == "Let me check."
            assert [(c.name, json.loads(c.arguments)) for c in calls] == [
                ("get_weather", {"city": "Paris"}),
                ("get_time", {}),
            ]
            assert len({c.id for c in calls}) == 2


def test_parser_keeps_what_is_not_a_call_as_content() -> None:
    for text in ("a < b and <tool", "<tool_call>\nnot json\n</tool_call>", '<tool_call>\n{"name"'):
        parser = ToolCallParser()
        content, calls = parser.feed(text, final=True)
        assert (content, calls) == (text, [])


def test_finish_reason_is_tool_calls_only_after_a_call() -> None:
    def chunk(text, finish=0):
        return gateway_pb2.GenerateChunk(text=text, finish_reason=finish)

    stop = common_pb2.FINISH_REASON_STOP
    out = list(
        parse_tool_calls([chunk("<tool_"), chunk('call>{"name": "get_time"}</tool_call>', stop)])
    )
    assert [c.text for c in out] == ["", ""] and out[-1].tool_calls[0].name == "get_time"
    assert out[-1].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    out = list(parse_tool_calls([chunk("plain answer", stop)]))
    assert out[-1].finish_reason == stop and out[-1].text == "plain answer"
    length = common_pb2.FINISH_REASON_LENGTH
    out = list(parse_tool_calls([chunk('<tool_call>{"name": "get_time"}</tool_call>', length)]))
    assert out[-1].finish_reason == length  # cut short: the finish says so


def test_each_choice_is_parsed_on_its_own() -> None:
    def chunk(index: int, text: str, reason: int = 0) -> gateway_pb2.GenerateChunk:
        return gateway_pb2.GenerateChunk(index=index, text=text, finish_reason=reason)

    stop = common_pb2.FINISH_REASON_STOP
    out = list(
        parse_tool_calls(
            [
                chunk(0, "<tool_"),
                chunk(1, "no call <tool_"),
                chunk(0, 'call>{"name": "get_time"}</tool_call>', stop),
                chunk(1, "here", stop),
            ]
        )
    )
    assert [(c.index, c.text) for c in out] == [
        (0, ""),
        (1, "no call "),
        (0, ""),
        (1, "<tool_here"),
    ]
    assert [c.name for c in out[2].tool_calls] == ["get_time"] and not out[3].tool_calls
    assert out[2].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    assert out[3].finish_reason == stop


def test_forced_choices_set_a_grammar_that_compiles() -> None:
    assert tool_grammar(_request()) == ""
    named = _request(choice=common_pb2.ToolChoice(function="get_weather"))
    grammar = tool_grammar(named)
    assert "get_weather" in grammar and "get_time" not in grammar
    required = tool_grammar(_request(choice=common_pb2.ToolChoice(mode="required")))
    assert "start: call+" in required
    assert with_tools(named).sampling.structured_output.grammar == grammar
    for g in (grammar, required):
        lark = llguidance.LLMatcher.grammar_from_lark(g)
        assert llguidance.LLMatcher.validate_grammar(lark) == ""


LIMITS = RequestLimits()


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (_request(tools=[common_pb2.Tool(name="bad name")]), "tools[0].name must be 1 to 64"),
        (_request(tools=[WEATHER, WEATHER]), "tools[1].name 'get_weather' is offered twice"),
        (_request(tools=[common_pb2.Tool(name="f", parameters="[1]")]),
         "tools[0].parameters must be a JSON object, got list"),
        (_request(tools=[common_pb2.Tool(name="f", parameters="{")]),
         "tools[0].parameters is not valid JSON"),
        (_request(choice=common_pb2.ToolChoice(mode="sometimes")),
         "tool_choice.mode must be one of"),
        (_request(choice=common_pb2.ToolChoice(function="nope")),
         "tool_choice.function 'nope' is not one of tools"),
        (_request(tools=[], choice=common_pb2.ToolChoice(mode="required")),
         "tool_choice 'required' needs tools"),
        (_request(_message("user", tool_calls=[common_pb2.ToolCall(name="f")])),
         "messages[0].tool_calls is only allowed on assistant messages"),
        (_request(_message("assistant", tool_calls=[common_pb2.ToolCall(name="f", arguments="3")])),
         "messages[0].tool_calls[0].arguments must be a JSON object"),
        (_request(_message("tool")), "messages[0].content must not be empty"),
        (gateway_pb2.GenerateRequest(prompt_text="Hi", tools=[WEATHER]),
         "tools need messages"),
    ],
)  # fmt: skip
def test_validation_names_the_field(request_, words) -> None:
    with pytest.raises(GatewayError) as info:
        validate_request(request_, LIMITS)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.message, info.value.message


def test_a_forced_call_cannot_have_another_structured_output() -> None:
    request = _request(choice=common_pb2.ToolChoice(mode="required"))
    request.sampling.structured_output.regex = "a+"
    with pytest.raises(GatewayError, match="cannot be combined with a tool_choice"):
        validate_request(request, LIMITS)
