"""Calls from the gateway to the workers, over each worker's long-lived channel.

Thin wrappers that turn protos into calls through the stubs made with the worker's channel
(``registry.create_stubs``). Failures come back as ``grpc.RpcError``, including a call to a
worker dropped meanwhile (``WorkerGone``: its channel is closed); deciding what they mean is
the orchestrator's job.
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health_pb2

from common import channels
from common.channels import DEFAULT_KEEPALIVE, ChannelSecurity, Keepalive
from common.drain import READINESS
from common.load_figures import descriptor, load_figures
from protos.epd.v1 import common_pb2, encoder_pb2, language_pb2
from services.gateway.registry import Role, Worker, WorkerStubs

logger = logging.getLogger(__name__)
MAX_UINT32 = (1 << 32) - 1
CANCEL_TIMEOUT_S = 1.0  # a cancel is a courtesy to the encoder; never wait long for it


class WorkerGone(grpc.RpcError):
    """A call to a worker that left the pool (the registry closed its channel)."""

    def __init__(self, worker: Worker) -> None:
        super().__init__(f"worker {worker.address} left the pool")
        self.address = worker.address

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return f"worker {self.address} left the pool"


def _stubs(worker: Worker) -> WorkerStubs:
    if worker.stubs is None:
        raise WorkerGone(worker)  # only registry test doubles have no stubs
    return worker.stubs


def _start(worker: Worker, start, request, timeout_s: float):
    """``start(request, timeout=...)``; WorkerGone when the worker's channel was closed."""
    try:
        return start(request, timeout=timeout_s)
    except ValueError:  # grpcio: "Cannot invoke RPC: Channel closed!"
        raise WorkerGone(worker) from None


def create_channel(
    address: str,
    max_message_mb: int = 64,
    security: ChannelSecurity | None = None,
    keepalive: Keepalive = DEFAULT_KEEPALIVE,
) -> grpc.Channel:
    """The gateway's long-lived channel to a worker (``common.channels.create_channel``)."""
    return channels.create_channel(address, security, max_message_mb, keepalive)


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
    request = encoder_pb2.EncodeRequest(
        room=room, request_id=request_id, messages=messages, timeout_s=timeout_s
    )
    if max_prompt_tokens:
        request.limits.max_prompt_tokens = min(max_prompt_tokens, MAX_UINT32)
    return _start(worker, _stubs(worker).service.Encode.future, request, timeout_s)


def cancel_room(
    worker: Worker, room: int, reason: str, timeout_s: float = CANCEL_TIMEOUT_S
) -> grpc.Future | None:
    """Best effort ``Encoder.Cancel``: returns at once; a failure is only logged."""
    request = encoder_pb2.CancelRequest(room=room, reason=reason)
    try:
        future = _start(worker, _stubs(worker).service.Cancel.future, request, timeout_s)
    except WorkerGone as exc:
        logger.info("cancel of room %d not sent: %s", room, exc.details())
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
    prompt_text: str = "",
    prompt_token_ids=(),
    echo: bool = False,
    sessions: bool = True,
):
    """Start a request on a language worker; returns its streaming call (iterable of
    ``LanguageGenerateChunk``, cancellable): in the worker's session (``sessions.py``) when
    ``sessions`` and the worker has them, else a ``Generate`` call. A text-only request carries
    ``messages`` or a raw prompt (text or token ids)."""
    request = language_pb2.LanguageGenerateRequest(
        request_id=request_id,
        room=room,
        encoder_endpoint=encoder_endpoint,
        messages=list(messages),
        sampling=sampling,
        prompt_text=prompt_text,
        prompt_token_ids=list(prompt_token_ids),
        echo=echo,
    )
    stubs = _stubs(worker)
    if sessions and stubs.sessions is not None and stubs.sessions.supported:
        try:
            call = stubs.sessions.submit(request, timeout_s)
        except ValueError:  # grpcio: "Cannot invoke RPC: Channel closed!"
            raise WorkerGone(worker) from None
        if call is not None:
            return call
    return _start(worker, stubs.service.Generate, request, timeout_s)


def poll(
    worker: Worker, timeout_s: float
) -> tuple[bool | None, dict[str, float], dict[str, str], dict]:
    """Readiness plus load of one worker: (healthy, load figures, info, descriptor); see
    ``common.load_figures``. A worker alive but not ready (starting, or draining after SIGTERM)
    is not healthy: it gets no traffic. ``healthy`` is None when the worker did not answer
    within ``timeout_s``: a busy worker is slow, not known to be gone."""
    try:
        stubs = _stubs(worker)
        check = health_pb2.HealthCheckRequest(service=READINESS)
        reply = _start(worker, stubs.health.Check, check, timeout_s)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return False, {}, {}, {}
        if worker.role == Role.ENCODER:
            load = _start(worker, stubs.service.GetLoad, encoder_pb2.GetLoadRequest(), timeout_s)
            info = {"transfer_endpoint": load.sender_endpoint}
        else:
            request = language_pb2.LanguageLoadRequest()
            load = _start(worker, stubs.service.GetLoad, request, timeout_s)
            info = {}
        return True, load_figures(load), info, descriptor(load)
    except grpc.RpcError as exc:
        slow = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return None if slow else False, {}, {}, {}
