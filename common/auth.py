"""Bearer-secret authentication of gRPC calls: the public API keys and the internal token.

Server side: ``BearerAuthInterceptor`` ends with ``UNAUTHENTICATED`` every call whose metadata
lacks ``authorization: Bearer <secret>`` for one of the accepted secrets, except the methods of
its open services: ``grpc.health.v1.Health`` always (kubelet probes and load balancers carry no
credentials). Server reflection is not open: it describes the whole surface, so it needs a
secret like any other call (grpcurl sends one with ``-H 'authorization: Bearer ...'``).
Client side: ``bearer_metadata``.

Comparison is constant-time: the presented secret and every accepted one are SHA-256 digests,
compared with ``hmac.compare_digest`` against every accepted secret without an early exit, so
timing reveals neither a secret's content nor its length nor which one matched. Secrets are
never logged or echoed in an error.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable, Sequence

import grpc

from common.rpc_handlers import refusing, service_of, with_behavior
from common.secret_files import SecretFile

HEALTH_SERVICE = "grpc.health.v1.Health"
AUTHORIZATION = "authorization"
SCHEME = "bearer"


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


class BearerKeys:
    """Accepted secrets: a fixed list and/or the lines of a ``SecretFile`` (kept current)."""

    def __init__(self, static: Iterable[str] = (), file: SecretFile | None = None) -> None:
        self._static = tuple(_digest(s.strip()) for s in static if s.strip())
        self._file = file
        # (the file's secrets, their digests), replaced as one object: readers on other threads
        # never pair one reading's secrets with another's digests
        self._hashed: tuple[tuple[str, ...], tuple[bytes, ...]] = ((), ())
        if not self._static and file is None:
            raise ValueError("BearerKeys needs at least one secret")

    def _digests(self) -> tuple[bytes, ...]:
        if self._file is None:
            return self._static
        values = self._file.values()
        hashed = self._hashed
        if values is not hashed[0]:  # re-hash only when the file was re-read
            hashed = (values, tuple(_digest(v) for v in values))
            self._hashed = hashed
        return self._static + hashed[1]

    def check(self, presented: str) -> bool:
        """True when ``presented`` is one of the accepted secrets (constant time)."""
        digest = _digest(presented)
        found = False
        for accepted in self._digests():
            found |= hmac.compare_digest(digest, accepted)
        return found


def bearer_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that presents ``secret``."""
    return ((AUTHORIZATION, f"Bearer {secret}"),)


def presented_secret(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The secret of an ``authorization: Bearer <secret>`` entry; "" when malformed, None when
    there is no such entry."""
    for key, value in metadata or ():
        if key != AUTHORIZATION:
            continue
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        scheme, _, secret = text.strip().partition(" ")
        return secret.strip() if scheme.lower() == SCHEME else ""
    return None


class BearerAuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without a valid bearer secret (``what`` names it in the error)."""

    def __init__(
        self,
        keys: BearerKeys,
        what: str,
        open_services: Iterable[str] = (HEALTH_SERVICE,),
        on_refuse: Callable[[str], None] | None = None,
    ) -> None:
        """``on_refuse(method)`` is called for every refused call (e.g. to count it)."""
        self._keys = keys
        self._what = what
        self._open = frozenset(open_services)
        self._on_refuse = on_refuse

    def problem(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """Why a call with ``metadata`` is refused, or None when it is authenticated."""
        secret = presented_secret(metadata)
        if secret is None:
            return f"missing {self._what}: send metadata 'authorization: Bearer <{self._what}>'"
        if not secret:
            return f"malformed authorization metadata: expected 'Bearer <{self._what}>'"
        if not self._keys.check(secret):
            return f"invalid {self._what}"
        return None

    def intercept_service(self, continuation, handler_call_details):
        if service_of(handler_call_details.method) in self._open:
            return continuation(handler_call_details)
        problem = self.problem(handler_call_details.invocation_metadata)
        handler = continuation(handler_call_details)
        if problem is None or handler is None:
            return handler
        if self._on_refuse is not None:
            self._on_refuse(handler_call_details.method)
        return with_behavior(handler, refusing(grpc.StatusCode.UNAUTHENTICATED, problem))
