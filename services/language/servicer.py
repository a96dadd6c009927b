"""Thin gRPC servicer: proto <-> engine types, everything else happens in the engine thread."""

from __future__ import annotations

import queue

import grpc

from protos.epd.v1 import common_pb2, language_pb2, language_pb2_grpc
from services.language.engine.request import FinishReason, RequestOutput
from services.language.engine.sampling import SamplingParams
from services.language.engine_thread import (
    INVALID_REQUEST,
    EngineThread,
    QueueFullError,
    Submission,
)

POLL_S = 0.5  # how often a stream waiting for output checks that the client is still there


def sampling_from_proto(p: common_pb2.SamplingParams, default_max_new_tokens: int):
    return SamplingParams(
        max_new_tokens=p.max_new_tokens or default_max_new_tokens,
        temperature=p.temperature,
        top_p=p.top_p if 0 < p.top_p < 1 else 1.0,
        top_k=p.top_k if p.top_k > 0 else 0,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
    )


def messages_from_proto(messages) -> list[dict]:
    out = []
    for m in messages:
        if any(part.WhichOneof("part") == "image" for part in m.content):
            raise ValueError("images must come through the encoder (room), not as messages")
        content = [{"type": "text", "text": part.text} for part in m.content]
        out.append({"role": m.role, "content": content})
    return out


def chunk_from_output(out: RequestOutput) -> language_pb2.LanguageGenerateChunk:
    chunk = language_pb2.LanguageGenerateChunk(text=out.text, token_ids=out.token_ids)
    if out.finished:
        chunk.finish_reason = int(out.finish_reason)
        chunk.usage.prompt_tokens = out.num_prompt_tokens
        chunk.usage.cached_tokens = out.num_cached_tokens
        chunk.usage.completion_tokens = out.num_completion_tokens
        t, p = chunk.timing, out.provenance
        t.ttft_seconds, t.total_seconds = out.ttft_s, out.total_s
        t.receive_seconds, t.queue_seconds, t.prefill_seconds = (
            out.receive_s,
            out.queue_s,
            out.prefill_s,
        )
        t.encode_seconds = p.get("encode_s", 0.0)
        t.transfer_seconds = p.get("transfer_s", 0.0)
        t.num_transfers = int(p.get("num_transfers", 0))
        t.num_encoder_cache_hits = int(p.get("num_encoder_cache_hits", 0))
        chunk.error = out.error
    return chunk


class LanguageServicer(language_pb2_grpc.LanguageServiceServicer):
    def __init__(self, engine_thread: EngineThread, default_max_new_tokens: int, source=None):
        self.engine_thread = engine_thread
        self.default_max_new_tokens = default_max_new_tokens
        self.source = source

    def Generate(self, request, context):
        if not request.request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        try:
            params = sampling_from_proto(request.sampling, self.default_max_new_tokens)
            messages = None if request.room else messages_from_proto(request.messages)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.room and not request.encoder_endpoint:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "room needs encoder_endpoint")
        if not request.room and not messages:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text-only request without messages")
        sub = Submission(
            request.request_id, params, messages, None, request.room, request.encoder_endpoint
        )
        try:
            stream = self.engine_thread.submit(sub)
        except QueueFullError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        context.add_callback(lambda: self.engine_thread.abort(request.request_id))
        while True:
            try:
                out = stream.get(timeout=POLL_S)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            if out.finish_reason == FinishReason.ERROR and out.error.startswith(INVALID_REQUEST):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, out.error)
            yield chunk_from_output(out)
            if out.finished:
                return

    def Abort(self, request, context):
        found = self.engine_thread.is_active(request.request_id)
        self.engine_thread.abort(request.request_id)
        return language_pb2.LanguageAbortResponse(found=found)

    def GetLoad(self, request, context):
        return load_reply(self.engine_thread, self.source)


def load_reply(engine_thread: EngineThread, source=None) -> language_pb2.LanguageLoad:
    """The worker's ``GetLoad`` reply (also what its heartbeats report)."""
    load = engine_thread.load()
    blocks = (
        source.block_stats()
        if source is not None
        else {"num_free_blocks": -1, "num_used_blocks": -1}
    )
    return language_pb2.LanguageLoad(
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        num_receiving=load.num_receiving,
        num_kv_slots_used=load.num_kv_slots_used,
        num_kv_slots_total=load.num_kv_slots_total,
        num_radix_hit_tokens=load.num_radix_hit_tokens,
        num_radix_tokens=load.num_radix_tokens,
        num_free_transfer_blocks=blocks["num_free_blocks"],
        num_used_transfer_blocks=blocks["num_used_blocks"],
        num_lent_transfer_blocks=blocks.get("num_lent_blocks", 0),
        num_rooms_lent=blocks.get("num_rooms_lent", 0),
    )
