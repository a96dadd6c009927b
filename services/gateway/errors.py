"""The one error type the gateway's domain code raises: a gRPC status and a message."""

from __future__ import annotations

import grpc

# The message of every CANCELLED the gateway itself answers: the client's cancel or an Abort.
# Any other CANCELLED comes from the transport (a call caught in a server's shutdown).
REQUEST_ABORTED = "request aborted"


class GatewayError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
