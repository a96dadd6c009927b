"""HTTP errors in OpenAI's JSON shape, and the gateway's gRPC statuses as HTTP statuses.

Every error the HTTP API returns is ``{"error": {"message", "type", "param", "code"}}`` with
the matching status. A ``GatewayError`` maps by its gRPC code (``STATUS``); an
``INVALID_ARGUMENT`` names the field in gRPC terms (``sampling.temperature``,
``messages[0].content[1].image.base64``), which ``convert.FieldNames`` turns into the request's
own JSON path (``temperature``, ``messages[0].content[1].image_url.url``) for ``param`` and the
message. Codes: the special ones OpenAI clients know (``invalid_api_key``,
``model_not_found``), else the gRPC status name in lower case.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import grpc

from services.gateway.errors import GatewayError

# gRPC status -> (HTTP status, OpenAI error type)
STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    # NOTE: a request the system (not the client) cancelled, e.g. a draining worker: retryable.
    grpc.StatusCode.CANCELLED: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
SERVER_ERROR = (500, "server_error")


@dataclass
class HttpError(Exception):
    """An error answer: HTTP status and OpenAI's error fields."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int = 0  # > 0: a Retry-After header

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def encoded(self) -> bytes:
        return json.dumps(self.body(), ensure_ascii=False).encode()

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after_s)} if self.retry_after_s else {}


def invalid(message: str, param: str | None) -> HttpError:
    """A 400 naming ``param``, for what only the HTTP API has (``n``, ``model``, parts)."""
    return HttpError(400, message, "invalid_request_error", param, "invalid_argument")


def from_gateway(exc: GatewayError, names=None) -> HttpError:
    """The HTTP error of a ``GatewayError``; ``names`` (``convert.FieldNames``) rewrites the
    gRPC field path of an ``INVALID_ARGUMENT`` into the request's JSON path."""
    status, kind = STATUS.get(exc.code, SERVER_ERROR)
    message, param = exc.message, None
    if exc.code == grpc.StatusCode.INVALID_ARGUMENT and names is not None:
        message, param = names.rewrite(message)
    retry_after = 1 if status in (429, 503) else 0
    return HttpError(status, message, kind, param, exc.code.name.lower(), retry_after)


# HTTP status -> the outcome label of a request refused by the HTTP layer itself
OUTCOMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    413: "RESOURCE_EXHAUSTED",
}
# HTTP status -> (OpenAI error type, code) of errors raised by the web framework
FRAMEWORK = {
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


def outcome_of(status: int) -> str:
    """The ``epd_gateway_requests_total`` outcome of a request the HTTP layer answered with
    ``status`` before it reached the gateway's front door."""
    return OUTCOMES.get(status, "UNKNOWN")


def status_error(status: int, message: str) -> HttpError:
    """An error of the web framework itself (unknown path, wrong method, body too large)."""
    default = ("invalid_request_error" if status < 500 else "server_error", None)
    kind, code = FRAMEWORK.get(status, default)
    return HttpError(status, message, kind, None, code)
