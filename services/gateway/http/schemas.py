"""The HTTP API's JSON shapes (OpenAI's chat completions, models, errors) as pydantic models.

They serve two purposes: FastAPI parses request bodies with them, and ``/openapi.json`` is
generated from them. Parsing checks JSON types only; every bound is checked once, by the
gateway's own validation of the ``GenerateRequest`` the body becomes (``convert.py``), so the
HTTP and gRPC APIs refuse the same requests with the same words. The fixed bounds appear in the
schema for clients and fuzzers (``json_schema_extra``), without being enforced twice.
``messages`` is parsed by ``convert.py`` as well (each message, part and image URL is checked
there with an error naming its path); its OpenAPI schema is the precise one below.

Responses are built as plain dicts (``convert.py``) for speed; their models here document them.
Unknown request fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from common.sampling_bounds import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_REPETITION_PENALTY,
)
from services.gateway.http.video_sampling import MM_PROCESSOR_KWARGS_SCHEMA, key_schemas
from services.gateway.validation import MAX_TEMPERATURE, MAX_TOP_LOGPROBS

MAX_SEED = (1 << 64) - 1
MAX_LEGACY_LOGPROBS = 5  # legacy completions' logprobs, as OpenAI's API bounds it

# ---- requests ----------------------------------------------------------------------------

TEXT_PART = {
    "type": "object",
    "title": "TextPart",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
IMAGE_PART = {
    "type": "object",
    "title": "ImagePart",
    "properties": {
        "type": {"const": "image_url"},
        "image_url": {
            "type": "object",
            "properties": {
                "url": {
                    "type": "string",
                    "description": "a data: URL (data:image/png;base64,...), or an http(s) URL "
                    "when the encoders allow remote images",
                },
                "detail": {"type": "string", "description": "accepted and ignored"},
            },
            "required": ["url"],
        },
    },
    "required": ["type", "image_url"],
}
VIDEO_PART = {
    "type": "object",
    "title": "VideoPart",
    "properties": {
        "type": {"const": "video_url"},
        "video_url": {
            "type": "object",
            "properties": {
                "url": {
                    "type": "string",
                    "description": "a data: URL (data:video/mp4;base64,...), or an http(s) URL "
                    "when the encoders allow remote media",
                },
                **key_schemas(),
            },
            "required": ["url"],
            "additionalProperties": False,
            "description": "url, and optionally this video's sampling (each key wins over the "
            "same key of mm_processor_kwargs; unset keys: the encoders' defaults)",
        },
    },
    "required": ["type", "video_url"],
}
MESSAGE = {
    "type": "object",
    "title": "ChatMessage",
    "properties": {
        "role": {
            "type": "string",
            "enum": ["system", "user", "assistant", "developer"],
            "description": "developer is taken as system",
        },
        "content": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {"anyOf": [TEXT_PART, IMAGE_PART, VIDEO_PART]},
                    "minItems": 1,
                },
            ]
        },
        "name": {"type": "string", "description": "accepted and ignored"},
    },
    "required": ["role", "content"],
}
MESSAGES_SCHEMA = {"type": "array", "items": MESSAGE, "minItems": 1}


def _one_or_list(value: Any) -> Any:
    """``stop``: a string is a list of one."""
    return [value] if isinstance(value, str) else value


StopList = Annotated[
    list[str] | None,
    BeforeValidator(_one_or_list),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}},
                {"type": "null"},
            ]
        }
    ),
]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one language for the answer (its other keys, backend
    choices and the like, are accepted and change nothing)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"maxProperties": 1})

    json_: dict[str, Any] | str | None = Field(
        None, alias="json", description="a JSON schema (an object, or its JSON text)"
    )
    regex: str | None = Field(None, json_schema_extra={"minLength": 1})
    choice: list[Annotated[str, WithJsonSchema({"type": "string", "minLength": 1})]] | None = Field(
        None, json_schema_extra={"minItems": 1}
    )
    grammar: str | None = Field(
        None, description="Lark, or GBNF", json_schema_extra={"minLength": 1}
    )
    json_object: bool | None = None


class SamplingFields(BaseModel):
    """The fields chat and legacy completions share: the model, sampling, structured output
    and streaming."""

    model_config = ConfigDict(extra="allow")  # vLLM's older guided_* fields among them

    model: str | None = Field(None, description="the served model ('' or omitted: that one)")
    max_tokens: int | None = Field(None, json_schema_extra={"minimum": 1})
    temperature: float | None = Field(
        None,
        description="0 = greedy; otherwise at least 0.01",
        json_schema_extra={"minimum": 0, "maximum": MAX_TEMPERATURE},
    )
    top_p: float | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 1})
    seed: int | None = Field(None, json_schema_extra={"minimum": -(1 << 63), "maximum": MAX_SEED})
    stop: StopList = None
    n: int | None = Field(
        None,
        description="choices; with a seed, choice i samples with seed + i",
        json_schema_extra={"minimum": 1, "maximum": MAX_N},
    )
    frequency_penalty: float | None = Field(
        None,
        description="minus this times each generated token's count",
        json_schema_extra={"minimum": -MAX_ABS_PENALTY, "maximum": MAX_ABS_PENALTY},
    )
    presence_penalty: float | None = Field(
        None,
        description="minus this once for each token generated so far",
        json_schema_extra={"minimum": -MAX_ABS_PENALTY, "maximum": MAX_ABS_PENALTY},
    )
    logit_bias: dict[str, float] | None = Field(
        None,
        description="token id (as a string) -> bias added to its logit",
        json_schema_extra={
            "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {
                "type": "number",
                "minimum": -MAX_ABS_LOGIT_BIAS,
                "maximum": MAX_ABS_LOGIT_BIAS,
            },
        },
    )
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # Extensions, as SGLang and vLLM accept them.
    top_k: int | None = Field(
        None, description="extension: 0 or -1 = off", json_schema_extra={"minimum": -1}
    )
    ignore_eos: bool | None = Field(None, description="extension: decode past EOS")
    stop_token_ids: (
        list[Annotated[int, WithJsonSchema({"type": "integer", "minimum": 0})]] | None
    ) = Field(None, description="extension: stop at these ids")
    repetition_penalty: float | None = Field(
        None,
        description="extension: 1 = off; divides positive (multiplies negative) logits of the "
        "prompt's and generated tokens",
        json_schema_extra={"exclusiveMinimum": 0, "maximum": MAX_REPETITION_PENALTY},
    )
    min_p: float | None = Field(
        None,
        description="extension: drop tokens below min_p times the most likely one's probability",
        json_schema_extra={"minimum": 0, "maximum": 1},
    )
    min_tokens: int | None = Field(
        None,
        description="extension: EOS and stop_token_ids are masked until this many tokens",
        json_schema_extra={"minimum": 0},
    )
    response_format: dict[str, Any] | None = Field(
        None, description="text, json_object, or json_schema (structured output)"
    )
    # Structured output as vLLM names it (this, or response_format). vLLM's older top-level
    # guided_json, guided_regex, guided_choice and guided_grammar are taken as well
    # (``structured.py``) but left out of the published schema: they are deprecated there.
    structured_outputs: StructuredOutputs | None = Field(
        None, description="extension: exactly one of json, regex, choice, grammar, json_object"
    )


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. Omitted sampling fields take OpenAI's defaults
    (temperature 1, top_p 1); ``temperature: 0`` is greedy decoding."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "examples": [
                {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8},
                {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
                 "stream": True, "stream_options": {"include_usage": True}},
            ]
        },
    )  # fmt: skip

    messages: Annotated[list[Any], WithJsonSchema(MESSAGES_SCHEMA)]
    max_completion_tokens: int | None = Field(
        None, description="wins over max_tokens", json_schema_extra={"minimum": 1}
    )
    logprobs: bool | None = Field(None, description="each generated token's log-probability")
    top_logprobs: int | None = Field(
        None,
        description="and this many most likely tokens at each step (needs logprobs: true)",
        json_schema_extra={"minimum": 0, "maximum": MAX_TOP_LOGPROBS},
    )
    tools: list[dict[str, Any]] | None = Field(
        None, description="functions the model may call ({type: function, function: {...}})"
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="auto, none, required, or {type: function, function: {name}}"
    )
    # checked by ``video_sampling.py`` (a 400 naming the key), like ``messages``
    mm_processor_kwargs: Annotated[Any, WithJsonSchema(MM_PROCESSOR_KWARGS_SCHEMA)] = None


TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        TOKEN_IDS,
        {
            "type": "array",
            "items": {"anyOf": [{"type": "string", "minLength": 1}, TOKEN_IDS]},
            "minItems": 1,
        },
    ],
    "description": "text (tokenized without a chat template) or token ids, or a list of such "
    "prompts (one choice each)",
}


class CompletionRequest(SamplingFields):
    """``POST /v1/completions`` (OpenAI's legacy completions): a raw prompt, no chat template.
    ``max_tokens`` defaults to 16 as in OpenAI's API."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "examples": [
                {"prompt": "The capital of France is", "max_tokens": 8},
                {"prompt": "The capital of France is", "max_tokens": 8, "stream": True},
                {"prompt": "Score this", "max_tokens": 0, "echo": True, "logprobs": 1},
            ]
        },
    )

    prompt: Annotated[Any, WithJsonSchema(PROMPT_SCHEMA)]
    max_tokens: int | None = Field(
        None,
        description="default 16; 0 only with echo: the prompt alone (its log-probabilities)",
        json_schema_extra={"minimum": 0},
    )
    echo: bool | None = Field(None, description="the prompt precedes the completion in text")
    logprobs: int | None = Field(
        None,
        description="each token's log-probability and this many most likely tokens",
        json_schema_extra={"minimum": 0, "maximum": MAX_LEGACY_LOGPROBS},
    )
    prompt_logprobs: int | None = Field(
        None,
        description="extension (vLLM): each prompt token's log-probability and this many top ones",
        json_schema_extra={"minimum": 0, "maximum": MAX_TOP_LOGPROBS},
    )
    suffix: str | None = Field(None, description="not supported (400)")
    best_of: int | None = Field(
        None,
        description="1 or n (every choice is returned)",
        json_schema_extra={"minimum": 1, "maximum": MAX_N},
    )


# ---- responses ---------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None when the answer is only tool calls
    tool_calls: list[ToolCall] | None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class TopLogprobEntry(BaseModel):
    token: str  # the token decoded alone (U+FFFD for part of a UTF-8 character)
    logprob: float
    bytes: list[int]  # the token's own bytes


class LogprobEntry(TopLogprobEntry):
    top_logprobs: list[TopLogprobEntry]  # most likely first


class ChoiceLogprobs(BaseModel):
    """One entry per generated token (see ``replies.py``)."""

    content: list[LogprobEntry] | None
    refusal: None = None


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: None = None


class ToolCallDelta(ToolCall):
    index: int  # which call of the answer (a call comes whole, in one delta)


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: FinishReason | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One Server-Sent Event's data (``data: {...}``); the stream ends with ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    # {"tokens", "token_logprobs", "top_logprobs", "text_offset"} with ``logprobs``
    logprobs: dict[str, list[Any]] | None = None
    # with ``prompt_logprobs``: null for the first prompt token, then {token id: {"logprob",
    # "decoded_token", "rank" where known}}
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class TextCompletion(BaseModel):
    """The answer of ``POST /v1/completions``; streamed, each event is one with ``object``
    ``text_completion`` and the choice's text delta."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: None = None


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


class PoolHealth(BaseModel):
    healthy: int
    total: int


class Health(BaseModel):
    status: Literal["ok", "starting", "stopping"]
    workers: dict[str, PoolHealth]


# One Server-Sent Event of a streamed answer (``text/event-stream``), as OpenAPI 3.2 describes
# events: its data is a ChatCompletionChunk, an error, or the final [DONE].
CHAT_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "anyOf": [
                {"const": "[DONE]"},
                {
                    "type": "string",
                    "contentMediaType": "application/json",
                    "contentSchema": {
                        "anyOf": [
                            {"$ref": "#/components/schemas/ChatCompletionChunk"},
                            {"$ref": "#/components/schemas/ErrorResponse"},
                        ]
                    },
                },
            ]
        },
        "event": {"const": "message"},
    },
}


def _event_schema(chunk_schema: str) -> dict:
    """One Server-Sent Event of a streamed answer whose data is a ``chunk_schema``."""
    data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {
            "anyOf": [
                {"$ref": f"#/components/schemas/{chunk_schema}"},
                {"$ref": "#/components/schemas/ErrorResponse"},
            ]
        },
    }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"anyOf": [{"const": "[DONE]"}, data]},
            "event": {"const": "message"},
        },
    }


# A streamed legacy completion's events: each data is a TextCompletion (a text delta).
COMPLETION_EVENT = _event_schema("TextCompletion")
