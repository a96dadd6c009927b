"""The one error type the gateway's domain code raises: a gRPC status and a message."""

from __future__ import annotations

import grpc


class GatewayError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
