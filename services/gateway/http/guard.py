"""What every HTTP request passes before the app: the API key and the body size bound.

``Guard`` is a plain ASGI middleware (streams pass through untouched). With API keys configured,
the API paths (``/v1/...``) need ``Authorization: Bearer KEY`` for one of them: 401 in OpenAI's
shape otherwise, with ``WWW-Authenticate``. Keys are checked by the same ``common.auth.BearerKeys``
as the gRPC port (constant time, files re-read on change). ``/health``, ``/openapi.json`` and the
status page stay open; the status page shows worker addresses only to a caller with a valid key
(``dashboard.py``). Refused chat completions count under ``UNAUTHENTICATED`` with
``api="http"``, as the gRPC port counts its refusals.

A body larger than ``max_body_bytes`` (the gateway's ``max_message_mb``, the gRPC bound) is
refused with 413 before it is read when its ``Content-Length`` says so, else as soon as it grows
past the bound.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.auth import BearerKeys, presented_secret
from services.gateway.http.errors import HttpError

PROTECTED_PREFIX = "/v1/"


def key_problem(keys: BearerKeys | None, authorization: str | None) -> str | None:
    """Why a request with this ``Authorization`` header is refused; None when it may pass."""
    if keys is None:
        return None
    secret = presented_secret([("authorization", authorization)] if authorization else None)
    if secret is None:
        return "missing API key: send the header 'Authorization: Bearer <API key>'"
    if not secret:
        return "malformed Authorization header: expected 'Bearer <API key>'"
    if not keys.check(secret):
        return "invalid API key"
    return None


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        keys: BearerKeys | None,
        max_body_bytes: int,
        on_refuse: Callable[[str, str], None],
    ) -> None:
        """``on_refuse(path, outcome)`` is called for each POST refused here."""
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes
        self.on_refuse = on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if self.keys is not None and path.startswith(PROTECTED_PREFIX):
            problem = key_problem(self.keys, header(scope, b"authorization"))
            if problem is not None:
                if scope.get("method") == "POST":
                    self.on_refuse(path, "UNAUTHENTICATED")
                error = HttpError(401, problem, "authentication_error", None, "invalid_api_key")
                return await _refuse(send, error, [(b"www-authenticate", b"Bearer")])
        length = header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            if scope.get("method") == "POST":
                self.on_refuse(path, "RESOURCE_EXHAUSTED")
            return await _refuse(send, too_large(self.max_body_bytes))
        await self.app(scope, self._bounded(receive), send)

    def _bounded(self, receive: Receive) -> Receive:
        """``receive`` that stops a body without a length once it grows past the bound (the
        app answers the ``HTTPException`` with its 413)."""
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise HTTPException(413, too_large(self.max_body_bytes).message)
            return message

        return bounded


def too_large(max_body_bytes: int) -> HttpError:
    return HttpError(
        413,
        f"request body is larger than the limit of {max_body_bytes >> 20} MiB",
        "invalid_request_error",
        None,
        "request_too_large",
    )


async def _refuse(send: Send, error: HttpError, extra: list | None = None) -> None:
    headers = [(b"content-type", b"application/json"), *(extra or [])]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": error.encoded(), "more_body": False})
