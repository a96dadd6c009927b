"""An OpenAI chat-completions body -> the gateway's ``GenerateRequest`` proto.

The HTTP API is a translation: every message becomes one ``ChatMessage`` and every content part
one ``ContentPart``, in order (a string content is one text part), so message ``i`` part ``j``
of the JSON is message ``i`` part ``j`` of the proto. That 1:1 mapping is what lets
``FieldNames`` name a field the gateway's validation refused by its JSON path.

Checked here, with a 400 naming the JSON path: what only HTTP has (the shape of messages and
parts, part types, image URL forms, ``n``, ``stream_options``, fields asking for something
this server does not do), values the proto cannot hold (negative or out-of-range integers,
``logit_bias`` keys that are not integers, a ``repetition_penalty`` of 0, which the proto reads
as unset) and ``min_tokens`` past ``max_tokens`` (named as the request names it). Every other
bound is the gateway's validation's (``validation.validate_request``).

Video sampling (``mm_processor_kwargs`` and the keys of a ``video_url`` beside its ``url``)
is checked and merged by ``video_sampling.py``.

Image URLs: a ``data:`` URL must be base64 (``data:image/png;base64,...``) and travels as
``ImageSource.base64``; an ``http(s)`` URL travels as ``ImageSource.url`` and the encoders'
URL policy decides (off by default). Sampling defaults are OpenAI's (temperature 1, top_p 1).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from common.sampling_bounds import MAX_LOGIT_BIAS_ENTRIES, MAX_N, MAX_REPETITION_PENALTY
from protos.epd.v1 import common_pb2, gateway_pb2
from services.gateway.http.errors import HttpError, invalid
from services.gateway.http.schemas import ChatCompletionRequest, SamplingFields
from services.gateway.http.structured import structured_output
from services.gateway.http.video_sampling import (
    apply_request_sampling,
    part_sampling,
    request_sampling,
)
from services.gateway.validation import MAX_TOP_LOGPROBS, RequestLimits

MAX_UINT32 = (1 << 32) - 1
MAX_INT32 = (1 << 31) - 1
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1
ROLE_ALIASES = {"developer": "system"}
REQUEST_ID_HEADER = "X-Request-Id"
# A gRPC field path at the start of a validation message: "messages[2].content[0].image.data".
FIELD_PATH = re.compile(
    r"^(messages|sampling|request_id|tools|tool_choice|prompt_text|prompt_token_ids)"
    r"((?:\[\d+\])?(?:\.[a-z_0-9]+(?:\[\d+\])?)*)"
)
WORKER_PREFIX = "language worker "  # how the gateway names a worker whose refusal it passes on
SEGMENT = re.compile(r"\.?([a-z_0-9]+)(?:\[(\d+)\])?")
TOKEN_ID_KEY = re.compile(r"-?[0-9]+")  # a logit_bias key: a token id written as a string
SAMPLING_NAMES = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
    "min_p": "min_p",
    "min_tokens": "min_tokens",
    "top_logprobs": "top_logprobs",
    "prompt_logprobs": "prompt_logprobs",
}


@dataclass
class FieldNames:
    """Turns the gRPC field paths of validation messages into the request's JSON paths."""

    max_tokens_name: str = "max_tokens"
    structured_name: str = ""  # the JSON path of the structured output asked for
    string_contents: set[int] = field(default_factory=set)  # messages whose content is a str
    # sampling proto field -> JSON name, where an endpoint names one otherwise
    renamed: dict[str, str] = field(default_factory=dict)

    def rewrite(self, message: str) -> tuple[str, str | None]:
        """(``message`` in JSON terms, the JSON path it names or None). The path starts the
        message, or follows the "language worker ADDRESS: " of a worker's own refusal."""
        prefix, sep, rest = message.partition(": ")
        if sep and prefix.startswith(WORKER_PREFIX) and FIELD_PATH.match(rest):
            rewritten, param = self.rewrite(rest)
            return prefix + sep + rewritten, param
        match = FIELD_PATH.match(message)
        if match is None:
            return message, None
        param = self.json_path(match.group(0))
        rest = message[match.end() :].replace(" (0 = the server default)", "")
        return param + rest, param

    def json_path(self, path: str) -> str:
        if path == "request_id":
            return REQUEST_ID_HEADER
        if path.startswith("sampling.structured_output"):
            return self.structured_name or "response_format"
        if path.startswith(("tools", "tool_choice")) or ".tool_calls" in path:
            return _tool_path(path)
        if path.startswith(("prompt_text", "prompt_token_ids")):  # the one "prompt" it came as
            return "prompt" + path[path.find("[") :] if "[" in path else "prompt"
        if path.startswith("sampling."):
            name, _, rest = path[len("sampling.") :].partition("[")
            if name == "max_new_tokens":
                json_name = self.max_tokens_name
            else:
                json_name = self.renamed.get(name) or SAMPLING_NAMES[name]
            return json_name + (f"[{rest}" if rest else "")
        out, message = [], -1
        segments = SEGMENT.findall(path)
        for k, (name, index) in enumerate(segments):
            if name == "messages":
                message = int(index) if index else -1
                out.append(f"messages[{index}]" if index else "messages")
            elif name == "content" and message in self.string_contents:
                out.append("content")  # the string itself: no part index, no .text
                break
            elif name == "image":
                out.append("image_url")
            elif name == "video":
                out.append("video_url")
            elif name == "sampling" and out and out[-1] == "video_url":
                out.extend(key for key, _ in segments[k + 1 :])  # a key beside the url
                break
            elif out and out[-1] in ("image_url", "video_url"):
                out.append("url")  # data, base64, path or url: the one URL it came as
                if out[-2] == "video_url":
                    break  # video.source.<kind>: the one URL too
            else:
                out.append(f"{name}[{index}]" if index else name)
        return ".".join(out)


def _tool_path(path: str) -> str:
    """The JSON path of a tool field: OpenAI nests a tool's and a call's fields in "function"."""
    for proto, json_name in (
        (".name", ".function.name"),
        (".description", ".function.description"),
        (".parameters", ".function.parameters"),
        (".arguments", ".function.arguments"),
    ):
        if path.endswith(proto) and (path.startswith("tools[") or ".tool_calls[" in path):
            return path[: -len(proto)] + json_name
    if path == "tool_choice.function":
        return "tool_choice.function.name"
    return "tool_choice" if path == "tool_choice.mode" else path


def to_generate_request(
    body: ChatCompletionRequest, request_id: str, limits: RequestLimits
) -> tuple[gateway_pb2.GenerateRequest, FieldNames]:
    """The proto of ``body`` and how to name its fields; raises ``HttpError`` (400)."""
    _check_http_only(body)
    _check_counts(body.messages, limits)
    names = FieldNames()
    video_sampling = request_sampling(body.mm_processor_kwargs)
    # built in place: a part's base64 image is copied into the proto once (copying finished
    # messages into the request cost ~1 ms per MB of images for each level of nesting)
    request = gateway_pb2.GenerateRequest(request_id=request_id)
    for i, m in enumerate(body.messages):
        _message(m, i, names, request.messages.add())
    apply_request_sampling(request.messages, video_sampling)
    sampling = sampling_of(body, limits, names)
    sampling.logprobs = bool(body.logprobs)
    sampling.top_logprobs = body.top_logprobs or 0
    request.sampling.CopyFrom(sampling)
    request.tools.extend(_tool(t, i) for i, t in enumerate(body.tools or ()))
    if body.tool_choice is not None:
        request.tool_choice.CopyFrom(_tool_choice(body.tool_choice))
    return request, names


def check_choices_and_stream(body: SamplingFields) -> None:
    """``n`` (choices, at most ``MAX_N``) and ``stream_options`` (only with ``stream``)."""
    if body.n is not None and not 1 <= body.n <= MAX_N:
        raise invalid(f"n must be in [1, {MAX_N}], got {body.n}", "n")
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")


def _check_http_only(body: ChatCompletionRequest) -> None:
    check_choices_and_stream(body)
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise invalid("top_logprobs is only allowed when logprobs is true", "top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise invalid(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.top_logprobs}",
                "top_logprobs",
            )


def _check_counts(messages: list[Any], limits: RequestLimits) -> None:
    """The count bounds of validation, checked before any conversion work (same words)."""
    if len(messages) > limits.max_messages:
        raise invalid(
            f"messages has {len(messages)} entries, more than the limit of {limits.max_messages}",
            "messages",
        )
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and len(content) > limits.max_parts_per_message:
            raise invalid(
                f"messages[{i}].content has {len(content)} parts, more than the limit of "
                f"{limits.max_parts_per_message}",
                f"messages[{i}].content",
            )


def _message(raw: Any, i: int, names: FieldNames, message: common_pb2.ChatMessage) -> None:
    """``raw`` (the request's ``messages[i]``) written into ``message``."""
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise invalid(f"{where} must be an object with role and content", where)
    role = raw.get("role")
    if not isinstance(role, str):
        raise invalid(
            f"{where}.role must be a string (system, user, assistant or tool)", f"{where}.role"
        )
    content = raw.get("content")
    message.role = ROLE_ALIASES.get(role, role)
    calls = raw.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise invalid(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        message.tool_calls.extend(_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls))
    call_id = raw.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise invalid(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        message.tool_call_id = call_id
    if content is None and message.tool_calls:
        return  # an assistant turn that only called tools
    if isinstance(content, str):
        names.string_contents.add(i)
        message.content.add(text=content)
    elif isinstance(content, list):
        for j, part in enumerate(content):
            _part(part, f"{where}.content[{j}]", message.content.add())
    else:
        raise invalid(
            f"{where}.content must be a string or a list of content parts, got "
            f"{_json_type(content)}",
            f"{where}.content",
        )


def _function(raw: Any, where: str) -> dict:
    """The "function" object of a tool or a call: ``raw`` is ``{"type": "function",
    "function": {...}}``."""
    if not isinstance(raw, dict) or raw.get("type", "function") != "function":
        raise invalid(f"{where} must be an object of type 'function'", where)
    function = raw.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid(f"{where}.function must be an object with a string name", f"{where}.function")
    return function


def _tool(raw: Any, i: int) -> common_pb2.Tool:
    where = f"tools[{i}]"
    function = _function(raw, where)
    description = function.get("description", "")
    if not isinstance(description, str):
        raise invalid(
            f"{where}.function.description must be a string", f"{where}.function.description"
        )
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid(
            f"{where}.function.parameters must be a JSON schema (an object)",
            f"{where}.function.parameters",
        )
    text = "" if parameters is None else json.dumps(parameters, ensure_ascii=False)
    return common_pb2.Tool(name=function["name"], description=description, parameters=text)


def _tool_choice(raw: Any) -> common_pb2.ToolChoice:
    if isinstance(raw, str):
        return common_pb2.ToolChoice(mode=raw)
    if isinstance(raw, dict):
        function = _function(raw, "tool_choice")
        return common_pb2.ToolChoice(function=function["name"])
    raise invalid(
        "tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", "
        '"function": {"name": ...}}',
        "tool_choice",
    )


def _call(raw: Any, where: str) -> common_pb2.ToolCall:
    function = _function(raw, where)
    arguments = function.get("arguments", "")
    if isinstance(arguments, dict):  # some clients send the object itself
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise invalid(
            f"{where}.function.arguments must be a JSON object as a string",
            f"{where}.function.arguments",
        )
    call_id = raw.get("id", "")
    return common_pb2.ToolCall(
        id=call_id if isinstance(call_id, str) else "", name=function["name"], arguments=arguments
    )


def _media_url(raw: dict, where: str, kind: str) -> str:
    """The string ``url`` of an ``image_url`` / ``video_url`` part (``kind``)."""
    media = raw.get(kind)
    url = media.get("url") if isinstance(media, dict) else None
    if not isinstance(url, str):
        raise invalid(f"{where}.{kind} must be an object with a string url", f"{where}.{kind}")
    return url


def _part(raw: Any, where: str, part: common_pb2.ContentPart) -> None:
    """``raw`` (a content part at ``where``) written into ``part``."""
    if not isinstance(raw, dict):
        raise invalid(f"{where} must be an object with a type", where)
    kind = raw.get("type")
    if kind == "text":
        text = raw.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}.text must be a string", f"{where}.text")
        part.text = text
        return
    if kind == "image_url":
        url = _media_url(raw, where, kind)
        set_source(part.image, url, f"{where}.image_url.url")
        return
    if kind == "video_url":
        url = _media_url(raw, where, kind)
        set_source(part.video.source, url, f"{where}.video_url.url", "video", "video/mp4")
        part.video.sampling.CopyFrom(part_sampling(raw[kind], f"{where}.video_url"))
        return
    raise invalid(
        f"{where}.type must be 'text', 'image_url' or 'video_url', got {kind!r}"
        if kind is not None
        else f"{where}.type is required ('text', 'image_url' or 'video_url')",
        f"{where}.type",
    )


def set_source(
    source: common_pb2.ImageSource,
    url: str,
    where: str,
    noun: str = "image",
    mime: str = "image/png",
) -> None:
    """A ``data:`` URL (base64) or an ``http(s)`` URL set as an image (or video) source."""
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    if scheme == "data":
        header, comma, payload = url.partition(",")
        if not comma or not header.lower().endswith(";base64"):
            raise invalid(f"{where} must be a base64 data URL (data:{mime};base64,...)", where)
        if not payload.strip():
            raise invalid(f"{where} holds no {noun} data", where)
        source.base64 = url
        return
    if scheme in ("http", "https"):
        source.url = url
        return
    if not url:
        raise invalid(f"{where} must not be empty", where)
    got = f"scheme {scheme!r}" if scheme else "no scheme"
    raise invalid(f"{where} must be a data: URL or an http(s) URL, got {got}", where)


def sampling_of(
    body: SamplingFields, limits: RequestLimits, names: FieldNames, default_max_tokens: int = 0
) -> common_pb2.SamplingParams:
    """The sampling fields chat and legacy completions share (``default_max_tokens`` when
    ``max_tokens`` is missing; 0 = the gateway's default)."""
    s = common_pb2.SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        ignore_eos=bool(body.ignore_eos),
        n=body.n if body.n and body.n > 1 else 0,  # 0 = one choice, as a gRPC client sends it
    )
    name, value = "max_tokens", body.max_tokens
    if value is None and default_max_tokens:
        value = default_max_tokens
    if getattr(body, "max_completion_tokens", None) is not None:
        name, value = "max_completion_tokens", body.max_completion_tokens
    names.max_tokens_name = name
    if value is not None:
        if value < 1:
            raise invalid(f"{name} must be at least 1, got {value}", name)
        if value > MAX_UINT32:
            bound = limits.max_new_tokens_limit
            raise invalid(f"{name} must be at most {bound}, got {value}", name)
        s.max_new_tokens = value
    if body.top_k is not None:
        if not -MAX_INT32 <= body.top_k <= MAX_INT32:
            raise invalid(f"top_k must be in [-1, {limits.max_top_k}], got {body.top_k}", "top_k")
        s.top_k = body.top_k
    if body.seed is not None:
        if not MIN_SEED <= body.seed <= MAX_SEED:
            raise invalid(f"seed must be in [{MIN_SEED}, {MAX_SEED}], got {body.seed}", "seed")
        s.seed = body.seed & MAX_SEED  # a negative seed is its 64-bit two's complement
    for i, token_id in enumerate(body.stop_token_ids or ()):
        if not -MAX_INT32 <= token_id <= MAX_INT32:  # the gateway refuses negatives itself
            raise invalid(
                f"stop_token_ids[{i}] must be in [0, {MAX_INT32}], got {token_id}",
                f"stop_token_ids[{i}]",
            )
    s.stop_token_ids.extend(body.stop_token_ids or ())
    s.stop.extend(body.stop or ())
    structured, names.structured_name = structured_output(body)
    if structured is not None:
        s.structured_output.CopyFrom(structured)
    _controls(body, s, name, value)
    return s


def _controls(
    body: ChatCompletionRequest, s: common_pb2.SamplingParams, max_name: str, max_value: int | None
) -> None:
    """The logits controls; bounds are the gateway's, except what the proto cannot hold."""
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p"):
        value = getattr(body, name)
        if value is not None:
            setattr(s, name, value)
    if body.repetition_penalty is not None and body.repetition_penalty <= 0:
        raise invalid(  # 0 would travel as "unset" (off)
            f"repetition_penalty must be a finite number in (0, {MAX_REPETITION_PENALTY:g}], "
            f"got {body.repetition_penalty:g}",
            "repetition_penalty",
        )
    if body.min_tokens is not None:
        if not 0 <= body.min_tokens <= MAX_UINT32:
            raise invalid(
                f"min_tokens must be in [0, {MAX_UINT32}], got {body.min_tokens}", "min_tokens"
            )
        if max_value is not None and body.min_tokens > max_value:
            raise invalid(
                f"min_tokens must be at most {max_name} ({max_value}), got {body.min_tokens}",
                "min_tokens",
            )
        s.min_tokens = body.min_tokens
    bias = body.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:  # before converting a huge map
        raise invalid(
            f"logit_bias has {len(bias)} entries, more than the limit of {MAX_LOGIT_BIAS_ENTRIES}",
            "logit_bias",
        )
    for key, value in bias.items():
        if TOKEN_ID_KEY.fullmatch(key) is None:
            raise invalid(
                f"logit_bias keys must be token ids written as strings of digits, got {key!r}",
                "logit_bias",
            )
        token_id = int(key)
        if not -MAX_INT32 <= token_id <= MAX_INT32:  # the gateway refuses negatives itself
            raise invalid(
                f"logit_bias token ids must be in [0, {MAX_INT32}], got {token_id}", "logit_bias"
            )
        if token_id in s.logit_bias:  # "7" and "007"
            raise invalid(f"logit_bias has token id {token_id} twice", "logit_bias")
        s.logit_bias[token_id] = value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", bool: "a boolean", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__
    )


def check_model(asked: str | None, served: list[str]) -> str:
    """The model a request is served as: ``asked`` when it is one of ``served`` (or when no
    name is known to check against), the served one when it asks for none."""
    if not asked:
        return served[0] if served else ""
    if served and asked not in served:
        raise model_not_found(asked, served)
    return asked


def model_not_found(asked: str, served: list[str]) -> HttpError:
    serving = f"this server serves {', '.join(served)}" if served else "no model is served now"
    return HttpError(
        404,
        f"The model {asked!r} does not exist; {serving}",
        "invalid_request_error",
        "model",
        "model_not_found",
    )
