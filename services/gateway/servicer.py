"""Thin gRPC servicers of the gateway: the public API and the worker registry.

``Generate`` is the gRPC front door of ``frontdoor.FrontDoor`` (validation before admission,
orchestration, outcome metrics with ``api="grpc"``); the HTTP app is the other one.
``GenerateUnary`` is ``Generate`` answered in one message (``unary.py``).
A caller's identity (``caller_identity``) is the SHA-256 of its API key when it sends one
(``authorization: Bearer KEY``), else its peer address; ``Abort`` reaches only the caller's own
requests.
"""

from __future__ import annotations

import hashlib

import grpc

from common.advertise import unreachable_reason
from protos.epd.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
)
from services.gateway.config import GatewayConfig
from services.gateway.errors import GatewayError
from services.gateway.frontdoor import Api, FrontDoor
from services.gateway.registry import ROLES, Role, WorkerRegistry
from services.gateway.routing import worker_problems
from services.gateway.unary import unary_response
from services.gateway.validation import validate_request_id


def identity(authorization: str | None, peer: str) -> str:
    """Who is calling: ``key:<sha256 of the bearer API key>`` when ``authorization`` is
    ``Bearer KEY``, else ``peer:<peer>``. Both front doors name callers this way, so a key
    owns its requests whichever door it uses."""
    if authorization:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return "key:" + hashlib.sha256(token.strip().encode()).hexdigest()
    return "peer:" + peer


def caller_identity(context: grpc.ServicerContext) -> str:
    """The identity (``identity``) of a gRPC caller."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return identity(value, context.peer())
    return identity(None, context.peer())


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        config: GatewayConfig,
        front_door: FrontDoor,
        registry: WorkerRegistry,
    ) -> None:
        self.config = config
        self.front_door = front_door
        self.admission = front_door.admission
        self.registry = registry
        self.limits = front_door.limits

    def Generate(self, request, context):  # noqa: N802
        try:
            admitted = self.front_door.admit(request, caller_identity(context), Api.GRPC)
        except GatewayError as exc:
            context.abort(exc.code, exc.message)
        if not context.add_callback(admitted.cancel):  # client gone or deadline: cancel both
            admitted.cancel()
        try:
            yield from self.front_door.run(request, admitted, context.time_remaining(), Api.GRPC)
        except GatewayError as exc:
            context.abort(exc.code, exc.message)

    def GenerateUnary(self, request, context):  # noqa: N802
        """``Generate``'s chunks put together in one response (``unary.py``), every choice."""
        return unary_response(self.Generate(request, context))

    def Abort(self, request, context):  # noqa: N802
        """Abort a live request of this caller; NOT_FOUND for any other id (another caller's
        requests are not visible)."""
        try:
            validate_request_id(request.request_id, self.limits, required=True)
        except GatewayError as exc:
            context.abort(exc.code, exc.message)
        if not self.admission.abort(request.request_id, caller_identity(context)):
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no request {request.request_id!r} of this caller in flight",
            )
        return gateway_pb2.AbortResponse(aborted=True)


class RegistryServicer(registry_pb2_grpc.WorkerRegistryServicer):
    def __init__(self, registry: WorkerRegistry, interval_s: float) -> None:
        self.registry = registry
        self.interval_s = interval_s

    def Heartbeat(self, request, context):  # noqa: N802
        if request.role not in ROLES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"role {request.role!r} is not one of {', '.join(ROLES)}",
            )
        if not request.address or ":" not in request.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address must be host:port")
        unreachable = unreachable_reason(request.address, context.peer())
        if unreachable:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, unreachable)
        applied = self.registry.heartbeat(
            request.address,
            Role(request.role),
            max(request.capacity, 1),
            dict(request.load),
            dict(request.info),
            {
                "transfer_layout": _copy_layout(request.transfer_layout),
                "max_prompt_tokens": request.max_prompt_tokens,
                "max_seq_len": request.max_seq_len,
            },
            still_wanted=lambda: _caller_waits(context),
        )
        if not applied:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "heartbeat came after its deadline")
        return registry_pb2.HeartbeatResponse(interval_s=self.interval_s)

    def Deregister(self, request, context):  # noqa: N802
        self.registry.deregister(request.address)
        return registry_pb2.DeregisterResponse()

    def ListWorkers(self, request, context):  # noqa: N802
        workers = self.registry.all()
        problems = worker_problems(workers)
        return registry_pb2.ListWorkersResponse(
            workers=[
                registry_pb2.WorkerInfo(
                    address=w.address,
                    role=w.role.value,
                    healthy=w.healthy,
                    capacity=w.capacity,
                    in_flight=w.in_flight,
                    last_seen_s=self.registry.age_s(w),
                    load=w.load,
                    static=w.static,
                    info=w.info,
                    problem=problems.get(w.address, ""),
                    **w.descriptor,
                )
                for w in sorted(workers, key=lambda w: (w.role.value, w.address))
            ]
        )


def _copy_layout(layout: common_pb2.TransferLayout) -> common_pb2.TransferLayout:
    copy = common_pb2.TransferLayout()
    copy.CopyFrom(layout)
    return copy


def _caller_waits(context: grpc.ServicerContext) -> bool:
    """False once the caller gave up on this call (deadline passed, or cancelled). A worker
    that leaves first waits for its last heartbeat to return or time out, then deregisters: a
    heartbeat run after the worker stopped waiting for it must not register it again."""
    remaining = context.time_remaining()
    return context.is_active() and (remaining is None or remaining > 0)
