"""Validation of a public ``GenerateRequest`` before anything is admitted or routed.

``validate_request(request, limits)`` is a pure function over the proto and a ``RequestLimits``
(the request-limit block of ``GatewayConfig``): the gRPC servicer calls it now, an HTTP front door
can call it on the proto it builds. A bad request raises ``GatewayError(INVALID_ARGUMENT, msg)``
where ``msg`` names the field path (``messages[2].content[0].image.data``,
``sampling.temperature``), the bound, and the value it got. Nothing here decodes an image or
touches a worker: the checks are on sizes, counts, ranges and shapes only, so a request that
passes may still be refused by a worker (an undecodable image, a prompt too long after image
expansion), but no request that fails could have been served.

Invariants:
* floats are finite and in range (NaN compares false with every bound, so each check is
  written as ``not (lo <= x <= hi)``);
* every repeated field and every string or bytes field has an upper bound;
* ``seed`` is any uint64 and needs no check; ``max_new_tokens`` 0, ``top_p`` 0, ``top_k`` 0 or
  -1 and ``repetition_penalty`` 0 keep their proto meaning (server default / off);
* ``logit_bias`` ids are checked for sign only: the worker knows its vocabulary and refuses ids
  past it.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, fields

import grpc

from common.sampling_bounds import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_REPETITION_PENALTY,
)
from protos.epd.v1 import gateway_pb2
from services.gateway.errors import GatewayError
from services.gateway.media_sources import base64_chars, validate_source
from services.gateway.video_validation import validate_video

ROLES_ALLOWED = ("system", "user", "assistant", "tool")
MAX_TEMPERATURE = 100.0
# NOTE: a positive temperature below this scales logits past what float32 sampling can hold
# (logits / 1e-45 overflows to inf); the language worker clamps such values, the gateway refuses
# them so the caller learns that 0 is the way to ask for greedy decoding.
MIN_POSITIVE_TEMPERATURE = 1e-2
MAX_TOP_LOGPROBS = 20  # most likely tokens per step a request may ask for (as other APIs)
MAX_STRUCTURED_CHARS = 1 << 16  # a structured output's schema, regex or grammar, at most
MAX_CHOICES = 256  # strings a structured output's choice may list
MAX_TOOLS = 128  # functions one request may offer
MAX_TOOL_CALLS = 64  # calls one assistant message may carry
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
TOOL_CHOICE_MODES = ("auto", "none", "required")


@dataclass(frozen=True)
class RequestLimits:
    """Upper bounds of one request; the same names as the ``GatewayConfig`` fields."""

    max_messages: int = 256
    max_parts_per_message: int = 64
    max_text_chars: int = 1 << 20
    max_images: int = 16
    max_image_bytes: int = 20 << 20
    max_image_ref_chars: int = 8192
    max_videos: int = 2
    max_video_bytes: int = 64 << 20
    max_stop: int = 16
    max_stop_chars: int = 256
    max_stop_token_ids: int = 64
    max_top_k: int = 262144
    max_new_tokens_limit: int = 32768
    max_request_id_chars: int = 256

    @classmethod
    def from_config(cls, config: object) -> RequestLimits:
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    @property
    def max_base64_chars(self) -> int:
        """The base64 text of a ``max_image_bytes`` image (``media_sources.base64_chars``)."""
        return base64_chars(self.max_image_bytes)


def _float32(value: float) -> float:
    """``value`` rounded to float32, as a proto ``float`` field holds it."""
    return struct.unpack("f", struct.pack("f", value))[0]


def invalid(message: str) -> GatewayError:
    return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, message)


def validate_request(request: gateway_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """Raise ``GatewayError(INVALID_ARGUMENT)`` naming the first field that is out of bounds."""
    validate_request_id(request.request_id, limits, required=False)
    num_prompts = bool(request.messages) + bool(request.prompt_text)
    if num_prompts + bool(request.prompt_token_ids) > 1:
        raise invalid("set exactly one of messages, prompt_text, prompt_token_ids")
    if request.prompt_text or request.prompt_token_ids:
        _validate_raw_prompt(request, limits)
    else:
        _validate_messages(request, limits)
    _validate_sampling(request, limits)
    _validate_tools(request)


def _validate_raw_prompt(request: gateway_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """A raw prompt: text of at most ``max_text_chars``, or at most as many token ids (a token
    is at least one character), none negative."""
    if len(request.prompt_text) > limits.max_text_chars:
        raise invalid(
            f"prompt_text is {len(request.prompt_text)} characters, more than the limit of "
            f"{limits.max_text_chars}"
        )
    ids = request.prompt_token_ids
    if len(ids) > limits.max_text_chars:
        raise invalid(
            f"prompt_token_ids has {len(ids)} entries, more than the limit of "
            f"{limits.max_text_chars}"
        )
    for i, token_id in enumerate(ids):
        if token_id < 0:
            raise invalid(f"prompt_token_ids[{i}] must be >= 0, got {token_id}")


def validate_request_id(request_id: str, limits: RequestLimits, required: bool) -> None:
    if not request_id:
        if required:
            raise invalid("request_id is required")
        return
    if len(request_id) > limits.max_request_id_chars:
        raise invalid(
            f"request_id must be at most {limits.max_request_id_chars} characters, "
            f"got {len(request_id)}"
        )
    if not request_id.isprintable():
        raise invalid("request_id must consist of printable characters (no control characters)")


def _validate_messages(request: gateway_pb2.GenerateRequest, limits: RequestLimits) -> None:
    messages = request.messages
    if not messages:
        raise invalid("messages must not be empty")
    if len(messages) > limits.max_messages:
        raise invalid(
            f"messages has {len(messages)} entries, more than the limit of {limits.max_messages}"
        )
    num_text_chars = num_images = num_videos = 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.role not in ROLES_ALLOWED:
            raise invalid(
                f"{where}.role must be one of {', '.join(ROLES_ALLOWED)}, got {message.role!r}"
            )
        if message.tool_calls:
            _validate_calls(message, where)
        elif not message.content:
            raise invalid(f"{where}.content must not be empty")
        if len(message.content) > limits.max_parts_per_message:
            raise invalid(
                f"{where}.content has {len(message.content)} parts, more than the limit of "
                f"{limits.max_parts_per_message}"
            )
        for j, part in enumerate(message.content):
            which = part.WhichOneof("part")
            if which is None:
                raise invalid(f"{where}.content[{j}] is empty (set text, image or video)")
            if which != "text" and message.role == "tool":
                raise invalid(f"{where}.content[{j}] must be text (a tool's result)")
            if which == "text":
                num_text_chars += len(part.text)
                if num_text_chars > limits.max_text_chars:
                    raise invalid(
                        f"{where}.content[{j}].text brings the request's text to "
                        f"{num_text_chars} characters, more than the limit of "
                        f"{limits.max_text_chars}"
                    )
            elif which == "video":
                num_videos += 1
                if num_videos > limits.max_videos:
                    raise invalid(
                        f"{where}.content[{j}].video is video {num_videos} of the request, more "
                        f"than the limit of {limits.max_videos} videos"
                    )
                validate_video(part.video, f"{where}.content[{j}].video", limits, invalid)
            else:
                num_images += 1
                if num_images > limits.max_images:
                    raise invalid(
                        f"{where}.content[{j}].image is image {num_images} of the request, more "
                        f"than the limit of {limits.max_images} images"
                    )
                _validate_image(part.image, f"{where}.content[{j}].image", limits)


def _json_object(text: str, where: str) -> None:
    """``text`` is "" or a JSON object, within ``MAX_STRUCTURED_CHARS``."""
    if len(text) > MAX_STRUCTURED_CHARS:
        raise invalid(
            f"{where} is {len(text)} characters, more than the limit of {MAX_STRUCTURED_CHARS}"
        )
    if not text:
        return
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise invalid(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise invalid(f"{where} must be a JSON object, got {type(value).__name__}")


def _validate_calls(message, where: str) -> None:
    if message.role != "assistant":
        raise invalid(f"{where}.tool_calls is only allowed on assistant messages")
    if len(message.tool_calls) > MAX_TOOL_CALLS:
        raise invalid(
            f"{where}.tool_calls has {len(message.tool_calls)} entries, more than the limit of "
            f"{MAX_TOOL_CALLS}"
        )
    for k, call in enumerate(message.tool_calls):
        if not TOOL_NAME.fullmatch(call.name):
            raise invalid(
                f"{where}.tool_calls[{k}].name must be 1 to 64 of A-Z a-z 0-9 _ -, got "
                f"{call.name[:80]!r}"
            )
        _json_object(call.arguments, f"{where}.tool_calls[{k}].arguments")


def _validate_tools(request: gateway_pb2.GenerateRequest) -> None:
    if request.tools and not request.messages:
        raise invalid("tools need messages (a raw prompt has no turns to write them into)")
    if len(request.tools) > MAX_TOOLS:
        raise invalid(f"tools has {len(request.tools)} entries, more than the limit of {MAX_TOOLS}")
    names = set()
    for i, tool in enumerate(request.tools):
        if not TOOL_NAME.fullmatch(tool.name):
            raise invalid(
                f"tools[{i}].name must be 1 to 64 of A-Z a-z 0-9 _ -, got {tool.name[:80]!r}"
            )
        if tool.name in names:
            raise invalid(f"tools[{i}].name {tool.name!r} is offered twice")
        names.add(tool.name)
        if len(tool.description) > MAX_STRUCTURED_CHARS:
            raise invalid(
                f"tools[{i}].description is {len(tool.description)} characters, more than the "
                f"limit of {MAX_STRUCTURED_CHARS}"
            )
        _json_object(tool.parameters, f"tools[{i}].parameters")
    which = request.tool_choice.WhichOneof("choice")
    if which == "mode" and request.tool_choice.mode not in TOOL_CHOICE_MODES:
        raise invalid(
            f"tool_choice.mode must be one of {', '.join(TOOL_CHOICE_MODES)}, got "
            f"{request.tool_choice.mode[:80]!r}"
        )
    forced = which == "function" or request.tool_choice.mode == "required"
    if which == "function" and request.tool_choice.function not in names:
        raise invalid(
            f"tool_choice.function {request.tool_choice.function[:80]!r} is not one of tools"
        )
    if forced and not request.tools:
        raise invalid("tool_choice 'required' needs tools")
    if forced and request.sampling.HasField("structured_output"):
        raise invalid(
            "sampling.structured_output cannot be combined with a tool_choice that forces a "
            "call (the call's grammar is the structured output)"
        )


def _validate_image(image, where: str, limits: RequestLimits) -> None:
    validate_source(image, where, limits.max_image_bytes, limits.max_image_ref_chars, invalid)


def _validate_structured(so) -> None:
    """Shapes and sizes only: whether it is a usable language is the language worker's to say
    (it compiles it against the checkpoint's tokenizer)."""
    kind = so.WhichOneof("kind")
    where = f"sampling.structured_output.{kind}"
    if kind is None:
        raise invalid("sampling.structured_output must set one of json_schema, json_object, "
                      "regex, choice, grammar")  # fmt: skip
    if kind == "json_object":
        if not so.json_object:
            raise invalid(f"{where} must be true when set")
        return
    if kind == "choice":
        choices = so.choice.choices
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise invalid(f"{where} must list 1 to {MAX_CHOICES} strings, got {len(choices)}")
        for i, choice in enumerate(choices):
            if not choice:
                raise invalid(f"{where}.choices[{i}] must not be empty")
        total = sum(len(c) for c in choices)
    else:
        total = len(getattr(so, kind))
        if not total:
            raise invalid(f"{where} must not be empty")
    if total > MAX_STRUCTURED_CHARS:
        raise invalid(
            f"{where} is {total} characters, more than the limit of {MAX_STRUCTURED_CHARS}"
        )
    if kind == "json_schema":
        try:
            schema = json.loads(so.json_schema)
        except ValueError as exc:
            raise invalid(f"{where} is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise invalid(f"{where} must be a JSON schema (an object), got {type(schema).__name__}")


def _validate_sampling(request: gateway_pb2.GenerateRequest, limits: RequestLimits) -> None:
    s = request.sampling
    if s.max_new_tokens > limits.max_new_tokens_limit:
        raise invalid(
            f"sampling.max_new_tokens must be at most {limits.max_new_tokens_limit} "
            f"(0 = the server default), got {s.max_new_tokens}"
        )
    if not (math.isfinite(s.temperature) and 0 <= s.temperature <= MAX_TEMPERATURE):
        raise invalid(
            f"sampling.temperature must be a finite number in [0, {MAX_TEMPERATURE:g}], "
            f"got {s.temperature:g}"
        )
    if 0 < s.temperature < _float32(MIN_POSITIVE_TEMPERATURE):
        raise invalid(
            f"sampling.temperature must be 0 (greedy) or in [{MIN_POSITIVE_TEMPERATURE:g}, "
            f"{MAX_TEMPERATURE:g}], got {s.temperature:g}"
        )
    if not (math.isfinite(s.top_p) and 0 <= s.top_p <= 1):
        raise invalid(
            f"sampling.top_p must be a finite number in [0, 1] (0 or 1 = off), got {s.top_p:g}"
        )
    if not -1 <= s.top_k <= limits.max_top_k:
        raise invalid(
            f"sampling.top_k must be in [-1, {limits.max_top_k}] (0 or -1 = off), got {s.top_k}"
        )
    if s.top_logprobs > MAX_TOP_LOGPROBS:
        raise invalid(
            f"sampling.top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {s.top_logprobs}"
        )
    if s.n > MAX_N:
        raise invalid(f"sampling.n must be in [0, {MAX_N}] (0 or 1 = one choice), got {s.n}")
    if s.HasField("structured_output"):
        _validate_structured(s.structured_output)
    _validate_controls(s, limits)
    if s.HasField("prompt_logprobs"):
        if s.prompt_logprobs > MAX_TOP_LOGPROBS:
            raise invalid(
                f"sampling.prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], "
                f"got {s.prompt_logprobs}"
            )
        media = ("image", "video")
        if any(p.WhichOneof("part") in media for m in request.messages for p in m.content):
            raise invalid("sampling.prompt_logprobs is for text-only prompts (no images or videos)")
    if request.echo and not (request.prompt_text or request.prompt_token_ids):
        raise invalid("echo needs a raw prompt (prompt_text or prompt_token_ids)")
    if len(s.stop_token_ids) > limits.max_stop_token_ids:
        raise invalid(
            f"sampling.stop_token_ids has {len(s.stop_token_ids)} entries, more than the limit "
            f"of {limits.max_stop_token_ids}"
        )
    for i, token_id in enumerate(s.stop_token_ids):
        if token_id < 0:
            raise invalid(f"sampling.stop_token_ids[{i}] must be >= 0, got {token_id}")
    if len(s.stop) > limits.max_stop:
        raise invalid(
            f"sampling.stop has {len(s.stop)} entries, more than the limit of {limits.max_stop}"
        )
    for i, stop in enumerate(s.stop):
        if not stop:
            raise invalid(f"sampling.stop[{i}] must not be empty")
        if len(stop) > limits.max_stop_chars:
            raise invalid(
                f"sampling.stop[{i}] is {len(stop)} characters, more than the limit of "
                f"{limits.max_stop_chars}"
            )


def _validate_controls(s, limits: RequestLimits) -> None:
    """The logits controls: penalties, ``logit_bias``, ``min_p``, ``min_tokens``."""
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(s, name)
        if not (-MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY):
            raise invalid(
                f"sampling.{name} must be a finite number in [{-MAX_ABS_PENALTY:g}, "
                f"{MAX_ABS_PENALTY:g}], got {value:g}"
            )
    if not (0 <= s.repetition_penalty <= MAX_REPETITION_PENALTY):
        raise invalid(
            f"sampling.repetition_penalty must be a finite number in (0, "
            f"{MAX_REPETITION_PENALTY:g}] (0 or 1 = off), got {s.repetition_penalty:g}"
        )
    if not (0 <= s.min_p <= 1):
        raise invalid(f"sampling.min_p must be a finite number in [0, 1], got {s.min_p:g}")
    if s.min_tokens > limits.max_new_tokens_limit:
        raise invalid(
            f"sampling.min_tokens must be at most {limits.max_new_tokens_limit}, got {s.min_tokens}"
        )
    if s.max_new_tokens and s.min_tokens > s.max_new_tokens:
        raise invalid(
            f"sampling.min_tokens must be at most max_new_tokens ({s.max_new_tokens}), "
            f"got {s.min_tokens}"
        )
    if len(s.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid(
            f"sampling.logit_bias has {len(s.logit_bias)} entries, more than the limit of "
            f"{MAX_LOGIT_BIAS_ENTRIES}"
        )
    for token_id, bias in sorted(s.logit_bias.items()):
        if token_id < 0:
            raise invalid(f"sampling.logit_bias token ids must be >= 0, got {token_id}")
        if not (-MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS):
            raise invalid(
                f"sampling.logit_bias values must be finite numbers in [{-MAX_ABS_LOGIT_BIAS:g}, "
                f"{MAX_ABS_LOGIT_BIAS:g}], got {bias:g} for token {token_id}"
            )
