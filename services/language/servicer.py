"""Thin gRPC servicer: proto <-> engine types, everything else happens in the engine thread.

A ``Generate`` call blocks on its request's output queue (no polling); the client going away
(cancel, deadline, disconnect) aborts the request through ``context.add_callback``, and the
abort's output wakes the call. ``Open`` streams a session's outputs (``sessions.py``): one
message per engine step with the chunk of each of its requests that advanced, each naming its
request; ``Submit`` queues a request into a session (validated as ``Generate`` validates, the
same statuses; its deadline is its ``timeout_s``); the session's end aborts what is left in it.

Errors before the first token end the call with a status:
``INVALID_ARGUMENT`` (bad sampling, messages or a prompt over ``max_seq_len``, naming the
field and its bound), ``DEADLINE_EXCEEDED`` (the prompt did not arrive in time),
``RESOURCE_EXHAUSTED``, ``ALREADY_EXISTS``, ``UNAVAILABLE`` (in a session: ``Submit``'s status,
or the request's last chunk carrying it in ``status_code``); a request that fails while being
served ends with a chunk whose finish reason is ``ERROR`` and whose ``error`` says why.
"""

from __future__ import annotations

import time

import grpc

from common.transfer.layout import dtype_name, parse_dtype
from protos.epd.v1 import common_pb2, language_pb2, language_pb2_grpc
from services.language.engine.request import ErrorKind, RequestOutput
from services.language.engine.sampling import SamplingParams, StructuredOutput, TokenLogprob
from services.language.engine_thread import (
    DuplicateRequestError,
    EngineStoppedError,
    EngineThread,
    OutputSink,
    QueueFullError,
    Submission,
    coalesced,
    coalesced_outputs,
)
from services.language.sessions import Session, SessionClosedError, SessionTable

NO_DEADLINE_S = 1e9  # gRPC reports "no deadline" as ~2**63 seconds remaining
STATUS_OF_ERROR = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """The proto's unset values (0) mean: the worker's default max_new_tokens, top_p off,
    repetition_penalty off (1); top_k -1 is "off" as well, as in other serving APIs."""
    return SamplingParams(
        max_new_tokens=p.max_new_tokens or None,
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=0 if p.top_k == -1 else p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        min_p=p.min_p,
        min_tokens=p.min_tokens,
        structured=structured_from_proto(p.structured_output)
        if p.HasField("structured_output")
        else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        n=p.n or 1,
    )


def structured_from_proto(p: common_pb2.StructuredOutput) -> StructuredOutput | None:
    kind = p.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return StructuredOutput.choice(list(p.choice.choices))
    if kind == "json_object":
        return StructuredOutput("json_object") if p.json_object else None
    return StructuredOutput(kind, getattr(p, kind))


def messages_from_proto(messages) -> list[dict]:
    out = []
    for m in messages:
        if any(part.WhichOneof("part") in ("image", "video") for part in m.content):
            raise ValueError(
                "images and videos must come through the encoder (room), not as messages"
            )
        content = [{"type": "text", "text": part.text} for part in m.content]
        out.append({"role": m.role, "content": content})
    return out


def logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    top = [
        common_pb2.TopLogprob(
            token_id=t.token_id, logprob=t.logprob, token=t.token, token_bytes=t.token_bytes
        )
        for t in lp.top
    ]
    return common_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=top,
        token=lp.token,
        token_bytes=lp.token_bytes,
    )


def chunk_from_output(out: RequestOutput) -> language_pb2.LanguageGenerateChunk:
    return fill_chunk(language_pb2.LanguageGenerateChunk(), out)


def fill_chunk(
    chunk: language_pb2.LanguageGenerateChunk, out: RequestOutput
) -> language_pb2.LanguageGenerateChunk:
    """``chunk`` (empty) filled from ``out``."""
    chunk.text = out.text
    chunk.token_ids.extend(out.token_ids)
    chunk.index = out.index
    chunk.logprobs.extend(logprob_to_proto(lp) for lp in out.logprobs)
    chunk.prompt_logprobs.extend(logprob_to_proto(lp) for lp in out.prompt_logprobs)
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


def deadline_of(context) -> float | None:
    """The call's deadline on the ``time.monotonic`` clock, or None without one."""
    remaining = context.time_remaining()
    if remaining is None or remaining > NO_DEADLINE_S:
        return None
    return time.monotonic() + remaining


class LanguageServicer(language_pb2_grpc.LanguageServiceServicer):
    def __init__(
        self,
        engine_thread: EngineThread,
        source=None,
        max_requests: int = 0,
        capacity_message: str = "",
    ):
        """``max_requests`` (0: no bound) bounds the requests of all sessions together, as the
        stream capacity bounds ``Generate`` calls; beyond it ``Submit`` answers
        ``RESOURCE_EXHAUSTED`` with ``capacity_message``."""
        self.engine_thread = engine_thread
        self.source = source
        self.max_requests = max_requests
        self.capacity_message = capacity_message
        self.sessions = SessionTable()

    def Generate(self, request, context):
        sub = self._submission(request, context, deadline_of(context))
        stream = self._submit(sub, None, context)
        rid = request.request_id
        if not context.add_callback(lambda: self.engine_thread.abort(rid, stream)):
            self.engine_thread.abort(rid, stream)  # the call already ended
        echo = self._echo_text(request) if request.echo else ""
        echoed: set[int] = set()  # choices whose first chunk went out
        for out in coalesced_outputs(stream):
            if out.error_kind in STATUS_OF_ERROR:
                context.abort(STATUS_OF_ERROR[out.error_kind], out.error)
            chunk = chunk_from_output(out)
            if out.index not in echoed:  # each choice's first chunk
                chunk.prompt_text = echo
                echoed.add(out.index)
            yield chunk

    def Open(self, request, context):
        try:
            session = self.sessions.open(request.session_id)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        context.add_callback(lambda: self._close(session))  # wakes batches() at a cancel
        try:
            yield language_pb2.LanguageOutputs()  # open
            for outputs in session.batches():
                yield self._outputs_message(session, outputs)
        finally:
            self._close(session)

    def Submit(self, request, context):
        session = self.sessions.get(request.session_id)
        if session is None:
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"session {request.session_id!r} is not open on this worker",
            )
        if self.max_requests and self.engine_thread.num_active >= self.max_requests:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.capacity_message)
        timeout_s = request.timeout_s
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        sub = self._submission(request, context, deadline)
        try:
            session.track(sub.request_id, self._echo_text(request) if request.echo else "")
        except SessionClosedError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        try:
            self._submit(sub, session, context)
        except BaseException:  # refused: the call ends with its status
            session.untrack(sub.request_id)
            raise
        if session.closed:  # its end came between track() and submit(): nobody will read it
            self.engine_thread.abort(sub.request_id, session)
        return language_pb2.LanguageSubmitReply()

    def _close(self, session: Session) -> None:
        """End ``session``: abort every request still in it (idempotent)."""
        for request_id in self.sessions.close(session):
            self.engine_thread.abort(request_id, session)

    @staticmethod
    def _outputs_message(session: Session, outputs) -> language_pb2.LanguageOutputs:
        """One step's (or several queued steps') outputs as one message: a chunk per request
        and choice (``coalesced``), each naming its request."""
        message = language_pb2.LanguageOutputs()
        for out in coalesced(outputs):
            chunk = fill_chunk(message.chunks.add(), out)
            chunk.request_id, chunk.last = out.request_id, out.ends_request
            chunk.prompt_text = session.sent(out)
            if out.error_kind in STATUS_OF_ERROR:
                chunk.status_code = STATUS_OF_ERROR[out.error_kind].value[0]
        return message

    def _submit(self, sub: Submission, sink: OutputSink | None, context) -> OutputSink:
        """``engine_thread.submit``; aborts the call with the status of a refusal."""
        try:
            return self.engine_thread.submit(sub, sink)
        except QueueFullError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except DuplicateRequestError as exc:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except EngineStoppedError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    def _echo_text(self, request) -> str:
        """The raw prompt's text: as sent, or its token ids decoded (special tokens kept)."""
        if request.prompt_text:
            return request.prompt_text
        tokenizer = self.engine_thread.engine.tokenizer
        return tokenizer.decode(list(request.prompt_token_ids), skip_special_tokens=False)

    def _submission(self, request, context, deadline: float | None) -> Submission:
        """The request as the engine thread takes it; aborts the call when it is malformed."""
        if not request.request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        prompts = [
            bool(request.messages),
            bool(request.prompt_text),
            bool(request.prompt_token_ids),
        ]
        if sum(prompts) > 1 or (request.room and any(prompts[1:])):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "set at most one of room, messages, prompt_text, prompt_token_ids",
            )
        try:
            params = sampling_from_proto(request.sampling)
            messages = None if request.room else messages_from_proto(request.messages) or None
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.room and not request.encoder_endpoint:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "room needs encoder_endpoint")
        if request.room and self.source is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker receives no rooms")
        if not request.room and not any(prompts):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text-only request without a prompt")
        if request.room and params.prompt_logprobs is not None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "prompt_logprobs is for text-only prompts"
            )
        if request.echo and not any(prompts[1:]):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "echo needs prompt_text or ids")
        return Submission(
            request.request_id,
            params,
            messages,
            request.prompt_text or None,
            list(request.prompt_token_ids) or None,
            room=request.room,
            encoder_endpoint=request.encoder_endpoint,
            deadline=deadline,
        )

    def Abort(self, request, context):
        found = self.engine_thread.is_active(request.request_id)
        self.engine_thread.abort(request.request_id)
        return language_pb2.LanguageAbortResponse(found=found)

    def GetLoad(self, request, context):
        return load_reply(self.engine_thread, self.source)


def load_reply(engine_thread: EngineThread, source=None) -> language_pb2.LanguageLoad:
    """The worker's ``GetLoad`` reply (also what its heartbeats report): its load, the rows it
    receives (``transfer_layout``) and the longest sequence it takes (``max_seq_len``)."""
    load = engine_thread.load()
    engine = engine_thread.engine
    model, transfer = engine.model_config, engine.config.transfer
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
        num_radix_locked_tokens=load.num_radix_locked_tokens,
        num_free_transfer_blocks=blocks["num_free_blocks"],
        num_used_transfer_blocks=blocks["num_used_blocks"],
        num_lent_transfer_blocks=blocks.get("num_lent_blocks", 0),
        num_rooms_lent=blocks.get("num_rooms_lent", 0),
        transfer_layout=common_pb2.TransferLayout(
            hidden_size=model.hidden_size,
            num_deepstack=model.num_deepstack,
            dtype=dtype_name(parse_dtype(transfer.dtype)),
            block_size=transfer.block_size,
        ),
        max_seq_len=engine.max_seq_len,
    )
