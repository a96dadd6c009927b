"""gRPC servicer of ``epd.v1.Encoder``: proto -> domain -> ``EncoderService``, errors -> codes."""

from __future__ import annotations

import logging

import grpc

from protos.epd.v1 import encoder_pb2, encoder_pb2_grpc

from . import convert
from .errors import (
    DeadlineExpired,
    InvalidInput,
    Overloaded,
    RequestCancelled,
    RoomInUse,
    UnknownRoom,
)
from .service import EncoderService
from .types import RoomStatus

logger = logging.getLogger(__name__)
MAX_WAIT_S = 600.0


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, service: EncoderService) -> None:
        self.service = service

    def Encode(self, request, context):  # noqa: N802
        try:
            domain = convert.request_from_proto(request)
        except InvalidInput as exc:
            self.service.refuse(request.room, str(exc))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            accepted = self.service.accept(domain)
        except InvalidInput as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RoomInUse as exc:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except DeadlineExpired as exc:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except RequestCancelled as exc:
            context.abort(grpc.StatusCode.CANCELLED, str(exc))
        return convert.reply_to_proto(accepted, self.service.sender.endpoint)

    def WaitEncoded(self, request, context):  # noqa: N802
        timeout_s = min(max(request.timeout_s, 0.0), MAX_WAIT_S)
        try:
            record = self.service.wait(request.room, RoomStatus(request.until), timeout_s)
        except UnknownRoom:
            context.abort(grpc.StatusCode.NOT_FOUND, f"room {request.room} is not known here")
        return convert.outcome_to_proto(record)

    def GetLoad(self, request, context):  # noqa: N802
        return convert.load_to_proto(self.service.load())

    def Cancel(self, request, context):  # noqa: N802
        found = self.service.cancel(request.room, request.reason)
        return encoder_pb2.CancelReply(found=found)
