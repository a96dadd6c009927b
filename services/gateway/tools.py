"""Tools (function calling) in the Qwen chat format, done at the gateway.

Qwen models call tools in the Hermes style: the functions are listed as JSON inside
``<tools></tools>`` at the end of the system message, a call is a JSON object
``{"name": ..., "arguments": {...}}`` inside ``<tool_call></tool_call>`` in the assistant's
text, and a tool's result comes back in a user turn inside ``<tool_response></tool_response>``.
The gateway renders all of it into plain chat messages (``prompt_messages``), so the encoders
and language workers render them with the checkpoint's chat template like any other chat
(whether that template knows tools or not, as Qwen2-VL's and Qwen2.5-VL's do not), and it
parses calls out of the answer (``ToolCallParser``) for both front doors.

``tool_choice``: ``auto`` (the default with tools) lets the model choose and parses its calls;
``none`` leaves the tools out of the prompt and parses nothing; ``required`` and a named
function are enforced with a structured-output grammar (``tool_grammar``): the answer is one
or more calls (``required``) or exactly one call of that function, with arguments that follow
the function's JSON schema.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from protos.epd.v1 import common_pb2, gateway_pb2

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
DEFAULT_SYSTEM = "You are a helpful assistant."  # what the Qwen templates say without a system turn
TOOLS_PROMPT = (
    "\n\n# Tools\n\nYou can call functions to help with the user's request. Their signatures "
    "are listed in <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\nTo call a function, "
    "write a JSON object with its name and its arguments in <tool_call></tool_call> tags, one "
    "pair of tags per call:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def choice_of(request: gateway_pb2.GenerateRequest) -> str:
    """ "auto", "none", "required" or "function" (then ``request.tool_choice.function``)."""
    which = request.tool_choice.WhichOneof("choice")
    if which == "function":
        return "function"
    return request.tool_choice.mode if which == "mode" and request.tool_choice.mode else "auto"


def uses_tools(request: gateway_pb2.GenerateRequest) -> bool:
    """Whether the answer is parsed for tool calls."""
    return bool(request.tools) and choice_of(request) != "none"


def _tool_json(tool: common_pb2.Tool) -> str:
    function: dict = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = json.loads(tool.parameters) if tool.parameters else {}
    return json.dumps({"type": "function", "function": function}, ensure_ascii=False)


def _call_text(call: common_pb2.ToolCall) -> str:
    arguments = json.loads(call.arguments) if call.arguments else {}
    body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def prompt_messages(request: gateway_pb2.GenerateRequest) -> list[common_pb2.ChatMessage]:
    """``request``'s messages with its tools, calls and results written in the Qwen format (the
    messages unchanged when it has none of them). Validation has checked the JSON."""
    has_turns = any(m.role == "tool" or m.tool_calls for m in request.messages)
    with_tools = bool(request.tools) and choice_of(request) != "none"
    if not (has_turns or with_tools):
        return list(request.messages)
    out: list[common_pb2.ChatMessage] = []
    results_turn = False  # the last message of ``out`` is a user turn of tool results
    for message in request.messages:
        if message.role == "tool":  # consecutive results share one user turn
            text = "".join(p.text for p in message.content if p.WhichOneof("part") == "text")
            response = f"<tool_response>\n{text}\n</tool_response>"
            if results_turn:
                out[-1].content.add(text="\n" + response)
            else:
                out.append(common_pb2.ChatMessage(role="user"))
                out[-1].content.add(text=response)
            results_turn = True
            continue
        results_turn = False
        copy = common_pb2.ChatMessage(role=message.role)
        copy.content.extend(message.content)
        if message.tool_calls:
            calls = "\n".join(_call_text(c) for c in message.tool_calls)
            copy.content.add(text=("\n" if message.content else "") + calls)
        out.append(copy)
    if with_tools:
        block = TOOLS_PROMPT.format(tools="\n".join(_tool_json(t) for t in request.tools))
        if out and out[0].role == "system":
            out[0].content.add(text=block)
        else:
            system = common_pb2.ChatMessage(role="system")
            system.content.add(text=DEFAULT_SYSTEM + block)
            out.insert(0, system)
    return out


def tool_grammar(request: gateway_pb2.GenerateRequest) -> str:
    """The Lark grammar a ``required`` or named ``tool_choice`` forces ("" for the others):
    calls in the Qwen format whose JSON follows each function's schema."""
    choice = choice_of(request)
    if choice not in ("required", "function"):
        return ""
    tools = [
        t for t in request.tools if choice == "required" or t.name == request.tool_choice.function
    ]
    alternatives = []
    for tool in tools:
        schema = {
            "x-guidance": {"whitespace_flexible": False},
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                "arguments": json.loads(tool.parameters) if tool.parameters else {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        alternatives.append("%json " + json.dumps(schema))
    repeat = "+" if choice == "required" else ""
    rules = "\n".join(f"call_{i}: {alt}" for i, alt in enumerate(alternatives))
    calls = " | ".join(f"call_{i}" for i in range(len(alternatives)))
    opening, closing = json.dumps(CALL_OPEN + "\n"), json.dumps("\n" + CALL_CLOSE)
    return f"start: call{repeat}\ncall: {opening} ({calls}) {closing}\n{rules}\n"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _parsed(body: str) -> common_pb2.ToolCall | None:
    """The call a ``<tool_call>`` block holds, or None when it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return common_pb2.ToolCall(
        id=new_call_id(), name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False)
    )


@dataclass
class ToolCallParser:
    """Splits an answer's text into content and tool calls, as it streams.

    Text outside ``<tool_call>`` blocks is content; a block is held back until it closes and
    then becomes a call (a block that is not a valid call stays content, as written). Text that
    may be the start of an opening tag is held back until it is known not to be one."""

    _pending: str = ""  # held back: a possible tag start, or an open block
    _after_call: bool = False  # the last thing read was a call: a line break may follow it
    num_calls: int = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[common_pb2.ToolCall]]:
        """(content to send now, calls completed now) after ``text``; ``final`` flushes."""
        buf, content, calls = self._pending + text, [], []
        while True:
            if self._after_call and buf:
                self._after_call = False
                if buf.startswith("\n"):  # the line break between calls belongs to the format
                    buf = buf[1:]
            start = buf.find(CALL_OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(buf, CALL_OPEN)
                content.append(buf[: len(buf) - keep])
                buf = buf[len(buf) - keep :]
                break
            content.append(buf[:start])
            end = buf.find(CALL_CLOSE, start)
            if end < 0:
                if final:  # never closed (e.g. the length limit): it stays content
                    content.append(buf[start:])
                    buf = ""
                else:
                    buf = buf[start:]
                break
            call = _parsed(buf[start + len(CALL_OPEN) : end].strip())
            if call is None:
                content.append(buf[start : end + len(CALL_CLOSE)])
            else:
                calls.append(call)
                self._after_call = True
            buf = buf[end + len(CALL_CLOSE) :]
        self._pending = buf
        self.num_calls += len(calls)
        return "".join(content), calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (0 when none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(
    chunks: Iterable[gateway_pb2.GenerateChunk],
) -> Iterator[gateway_pb2.GenerateChunk]:
    """``chunks`` with their text split into content and ``tool_calls``, each choice
    (``index``) by its own parser; a choice's final chunk's finish reason is ``TOOL_CALLS`` when
    the model called any in it (and stopped by itself)."""
    parsers: dict[int, ToolCallParser] = {}
    for chunk in chunks:
        parser = parsers.setdefault(chunk.index, ToolCallParser())
        final = chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        text, calls = parser.feed(chunk.text, final)
        chunk.text = text
        chunk.tool_calls.extend(calls)
        if final and parser.num_calls and chunk.finish_reason == common_pb2.FINISH_REASON_STOP:
            chunk.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS
        yield chunk
