"""The one way this project opens a gRPC channel: message limits, keepalive, credentials.

The gateway's channels to workers, the workers' registrar, ``list_workers``, the local stack's
health checks and the tests all call ``create_channel``, so a deployment that turns on TLS or a
bearer token turns it on for every caller at once. ``ChannelSecurity`` says what a channel
presents: TLS (``common.tls.ClientTLS``) and/or a bearer secret sent as
``authorization: Bearer ...`` metadata on every call. A secret that comes from a
``SecretFile`` is read per call, so a rotated token is sent without reopening the channel.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import grpc

from common.auth import AUTHORIZATION, bearer_metadata
from common.secret_files import SecretFile
from common.tls import ClientTLS

MIN_PEER_PING_MS = 1000  # the most often a server lets a peer ping it


@dataclass(frozen=True)
class Keepalive:
    """HTTP/2 keepalive of one side of a connection: a ping every ``time_s``; a peer that does
    not answer one within ``timeout_s`` is cut off and the calls on the connection end
    ``UNAVAILABLE``. gRPC also sets the socket's ``TCP_USER_TIMEOUT`` to ``timeout_s``, so
    bytes sent and left unacknowledged that long end the connection too: a partitioned peer is
    found within ``timeout_s`` while a stream carries data, ``time_s + timeout_s`` when idle."""

    time_s: float = 10.0
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.time_s <= 0 or self.timeout_s <= 0:
            raise ValueError(f"keepalive times must be positive, got {self}")

    def channel_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.keepalive_time_ms", int(self.time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.timeout_s * 1000)),
        ]

    def server_options(self) -> list[tuple[str, int]]:
        """A server pings its callers the same way, and lets them ping it as often as this
        (gRPC's default refuses client pings more often than every 5 minutes on an idle
        connection, answering ``too_many_pings``)."""
        return [
            *self.channel_options(),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PEER_PING_MS),
            ("grpc.http2.max_ping_strikes", 0),
        ]


DEFAULT_KEEPALIVE = Keepalive()


@dataclass(frozen=True)
class ChannelSecurity:
    token: SecretFile | str | None = None  # bearer secret ("" / None: none)
    tls: ClientTLS | None = None  # None: plaintext

    def secret(self) -> str:
        if isinstance(self.token, SecretFile):
            return self.token.first()
        return self.token or ""


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _BearerInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <secret>`` to every call that does not carry one."""

    def __init__(self, security: ChannelSecurity) -> None:
        self._security = security

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = list(details.metadata or ())
        if not any(key == AUTHORIZATION for key, _ in metadata):
            metadata.extend(bearer_metadata(self._security.secret()))
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def create_channel(
    address: str,
    security: ChannelSecurity | None = None,
    max_message_mb: int = 64,
    keepalive: Keepalive | None = DEFAULT_KEEPALIVE,
) -> grpc.Channel:
    """A channel to ``address`` whose messages may be ``max_message_mb`` large, presenting
    ``security`` (plaintext and anonymous when None), pinging the peer as ``keepalive`` says
    (None: no pings, for short-lived channels)."""
    max_bytes = max_message_mb << 20
    options = [
        ("grpc.max_send_message_length", max_bytes),
        ("grpc.max_receive_message_length", max_bytes),
        *(keepalive.channel_options() if keepalive is not None else []),
    ]
    if security is not None and security.tls is not None:
        options += security.tls.options()
        channel = grpc.secure_channel(address, security.tls.credentials(), options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    if security is not None and security.token:
        channel = grpc.intercept_channel(channel, _BearerInterceptor(security))
    return channel
