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
* ``seed`` is any uint64 and needs no check; ``max_new_tokens`` 0, ``top_p`` 0 and ``top_k`` 0 or
  -1 keep their proto meaning (server default / off).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, fields

import grpc

from protos.epd.v1 import gateway_pb2
from services.gateway.errors import GatewayError

ROLES_ALLOWED = ("system", "user", "assistant")
MAX_TEMPERATURE = 100.0
# NOTE: a positive temperature below this scales logits past what float32 sampling can hold
# (logits / 1e-45 overflows to inf); the language worker clamps such values, the gateway refuses
# them so the caller learns that 0 is the way to ask for greedy decoding.
MIN_POSITIVE_TEMPERATURE = 1e-2
DATA_URL_PREFIX_CHARS = 256  # room for "data:image/png;base64," and the like
MAX_TOP_LOGPROBS = 20  # most likely tokens per step a request may ask for (as other APIs)


@dataclass(frozen=True)
class RequestLimits:
    """Upper bounds of one request; the same names as the ``GatewayConfig`` fields."""

    max_messages: int = 256
    max_parts_per_message: int = 64
    max_text_chars: int = 1 << 20
    max_images: int = 16
    max_image_bytes: int = 20 << 20
    max_image_ref_chars: int = 8192
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
        """The base64 text of a ``max_image_bytes`` image, with MIME line breaks (2 characters
        per 76) and a data-URL prefix."""
        chars = 4 * math.ceil(self.max_image_bytes / 3)
        return chars + 2 * math.ceil(chars / 76) + DATA_URL_PREFIX_CHARS


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
    num_text_chars = num_images = 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.role not in ROLES_ALLOWED:
            raise invalid(
                f"{where}.role must be one of {', '.join(ROLES_ALLOWED)}, got {message.role!r}"
            )
        if not message.content:
            raise invalid(f"{where}.content must not be empty")
        if len(message.content) > limits.max_parts_per_message:
            raise invalid(
                f"{where}.content has {len(message.content)} parts, more than the limit of "
                f"{limits.max_parts_per_message}"
            )
        for j, part in enumerate(message.content):
            which = part.WhichOneof("part")
            if which is None:
                raise invalid(f"{where}.content[{j}] is empty (set text or image)")
            if which == "text":
                num_text_chars += len(part.text)
                if num_text_chars > limits.max_text_chars:
                    raise invalid(
                        f"{where}.content[{j}].text brings the request's text to "
                        f"{num_text_chars} characters, more than the limit of "
                        f"{limits.max_text_chars}"
                    )
            else:
                num_images += 1
                if num_images > limits.max_images:
                    raise invalid(
                        f"{where}.content[{j}].image is image {num_images} of the request, more "
                        f"than the limit of {limits.max_images} images"
                    )
                _validate_image(part.image, f"{where}.content[{j}].image", limits)


def _validate_image(image, where: str, limits: RequestLimits) -> None:
    source = image.WhichOneof("source")
    if source is None:
        raise invalid(f"{where} has no source (set data, base64, path or url)")
    value = getattr(image, source)
    if not value:
        raise invalid(f"{where}.{source} is empty")
    if source == "data":
        bound, unit = limits.max_image_bytes, "bytes"
    elif source == "base64":
        bound, unit = limits.max_base64_chars, "characters"
    else:
        bound, unit = limits.max_image_ref_chars, "characters"
        if "\x00" in value:
            raise invalid(f"{where}.{source} must not contain NUL characters")
    if len(value) > bound:
        raise invalid(
            f"{where}.{source} is {len(value)} {unit}, more than the limit of {bound} {unit}"
        )


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
    if s.HasField("prompt_logprobs"):
        if s.prompt_logprobs > MAX_TOP_LOGPROBS:
            raise invalid(
                f"sampling.prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], "
                f"got {s.prompt_logprobs}"
            )
        if any(p.WhichOneof("part") == "image" for m in request.messages for p in m.content):
            raise invalid("sampling.prompt_logprobs is for text-only prompts (no images)")
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
