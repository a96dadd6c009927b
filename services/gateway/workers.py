"""Calls from the gateway to the workers, over each worker's long-lived channel.

Thin wrappers that turn protos into calls and keep the stubs next to the channel. Failures come
back as ``grpc.RpcError``; deciding what they mean is the orchestrator's job.
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.load_figures import descriptor, load_figures
from protos.epd.v1 import (
    common_pb2,
    encoder_pb2,
    encoder_pb2_grpc,
    language_pb2,
    language_pb2_grpc,
)
from services.gateway.registry import Role, Worker

logger = logging.getLogger(__name__)
MAX_UINT32 = (1 << 32) - 1
CANCEL_TIMEOUT_S = 1.0  # a cancel is a courtesy to the encoder; never wait long for it


def create_channel(address: str, max_message_mb: int = 64) -> grpc.Channel:
    max_bytes = max_message_mb << 20
    return grpc.insecure_channel(
        address,
        options=[
            ("grpc.max_send_message_length", max_bytes),
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
        ],
    )


def encode(
    worker: Worker,
    room: int,
    request_id: str,
    messages,
    timeout_s: float,
    max_prompt_tokens: int = 0,
) -> grpc.Future:
    """Start ``Encoder.Encode``; the future resolves once the encoder accepted or refused.

    ``timeout_s`` is the time the request has left (the encoder fails the room once it passed);
    ``max_prompt_tokens`` (0 = the encoder's own limit) is what the chosen language worker can
    hold beside the completion, so an over-long prompt is refused before any pixel work.
    """
    stub = encoder_pb2_grpc.EncoderStub(worker.channel)
    request = encoder_pb2.EncodeRequest(
        room=room, request_id=request_id, messages=messages, timeout_s=timeout_s
    )
    if max_prompt_tokens:
        request.limits.max_prompt_tokens = min(max_prompt_tokens, MAX_UINT32)
    return stub.Encode.future(request, timeout=timeout_s)


def cancel_room(
    worker: Worker, room: int, reason: str, timeout_s: float = CANCEL_TIMEOUT_S
) -> grpc.Future | None:
    """Best effort ``Encoder.Cancel``: returns at once; a failure is only logged."""
    stub = encoder_pb2_grpc.EncoderStub(worker.channel)
    try:
        future = stub.Cancel.future(
            encoder_pb2.CancelRequest(room=room, reason=reason), timeout=timeout_s
        )
    except ValueError as exc:  # the worker was dropped and its channel closed meanwhile
        logger.info("cancel of room %d on encoder %s not sent: %s", room, worker.address, exc)
        return None

    def done(f: grpc.Future) -> None:
        error = "cancelled" if f.cancelled() else f.exception()
        if error is not None:
            logger.info("cancel of room %d on encoder %s failed: %s", room, worker.address, error)

    future.add_done_callback(done)
    return future


def generate(
    worker: Worker,
    request_id: str,
    sampling: common_pb2.SamplingParams,
    timeout_s: float,
    room: int = 0,
    encoder_endpoint: str = "",
    messages=(),
):
    """Start ``LanguageService.Generate``; returns the streaming call (iterable, cancellable)."""
    stub = language_pb2_grpc.LanguageServiceStub(worker.channel)
    request = language_pb2.LanguageGenerateRequest(
        request_id=request_id,
        room=room,
        encoder_endpoint=encoder_endpoint,
        messages=list(messages),
        sampling=sampling,
    )
    return stub.Generate(request, timeout=timeout_s)


def poll(worker: Worker, timeout_s: float) -> tuple[bool, dict[str, float], dict[str, str], dict]:
    """Health plus load of one worker: (healthy, load figures, info, descriptor); see
    ``common.load_figures``."""
    try:
        reply = health_pb2_grpc.HealthStub(worker.channel).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout_s
        )
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return False, {}, {}, {}
        if worker.role == Role.ENCODER:
            load = encoder_pb2_grpc.EncoderStub(worker.channel).GetLoad(
                encoder_pb2.GetLoadRequest(), timeout=timeout_s
            )
            info = {"transfer_endpoint": load.sender_endpoint}
        else:
            load = language_pb2_grpc.LanguageServiceStub(worker.channel).GetLoad(
                language_pb2.LanguageLoadRequest(), timeout=timeout_s
            )
            info = {}
        return True, load_figures(load), info, descriptor(load)
    except grpc.RpcError:
        return False, {}, {}, {}
