"""The API key check of the HTTP port, before anything of the request is read.

``Guard`` is a plain ASGI middleware (streams pass through untouched). With API keys configured,
the API paths (``/v1/...``) need ``Authorization: Bearer KEY`` for one of them: 401 in OpenAI's
shape otherwise, with ``WWW-Authenticate``. Keys are checked by the same ``common.auth.BearerKeys``
as the gRPC port (constant time, files re-read on change). ``/health``, ``/openapi.json`` and the
status page stay open; the status page shows worker addresses only to a caller with a valid key
(``dashboard.py``). Refused chat completions count under ``UNAUTHENTICATED`` with
``api="http"``, as the gRPC port counts its refusals.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

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
        self, app: ASGIApp, keys: BearerKeys | None, on_refuse: Callable[[str], None]
    ) -> None:
        """``on_refuse(path)`` is called for each request refused for want of a key."""
        self.app = app
        self.keys = keys
        self.on_refuse = on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.keys is not None and scope["type"] == "http":
            path = scope.get("path", "")
            if path.startswith(PROTECTED_PREFIX):
                problem = key_problem(self.keys, header(scope, b"authorization"))
                if problem is not None:
                    self.on_refuse(path)
                    return await _refuse(send, problem)
        await self.app(scope, receive, send)


async def _refuse(send: Send, problem: str) -> None:
    error = HttpError(401, problem, "authentication_error", None, "invalid_api_key")
    headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": error.encoded(), "more_body": False})
