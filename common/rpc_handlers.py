"""Rewrapping a gRPC method handler's behavior, for server interceptors.

An interceptor that refuses or bounds calls must hand grpcio a handler of the same kind
(unary/stream request, unary/stream response) with the same (de)serializers; only the behavior
changes. ``with_behavior`` does that for all four kinds.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

# make(behavior, response_streaming) -> the new behavior. A response-streaming behavior must
# return an iterator (a generator function is the usual way).
BehaviorWrapper = Callable[[Callable, bool], Callable]

_FACTORIES = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def with_behavior(handler: grpc.RpcMethodHandler, make: BehaviorWrapper) -> grpc.RpcMethodHandler:
    """``handler`` whose behavior is ``make(behavior, response_streaming)``."""
    kind = (bool(handler.request_streaming), bool(handler.response_streaming))
    attribute, factory = _FACTORIES[kind]
    return factory(
        make(getattr(handler, attribute), kind[1]),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def refusing(code: grpc.StatusCode, message: str) -> BehaviorWrapper:
    """A wrapper whose behavior ends every call with ``code`` and ``message`` at once."""

    def make(_behavior: Callable, _response_streaming: bool) -> Callable:
        def refuse(_request, context: grpc.ServicerContext):
            context.abort(code, message)

        return refuse

    return make


def service_of(method: str) -> str:
    """``"pkg.Service"`` of a full method name ``"/pkg.Service/Method"``."""
    return method.lstrip("/").split("/", 1)[0]
