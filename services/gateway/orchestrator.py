"""One request's path through the pools.

The request arrives validated (``validation.py``). Language workers are ordered by their policy
(cache-aware, then load) and only those whose ``max_seq_len`` leaves room for
``max_new_tokens`` are kept.

Text only: the first language worker streams the answer from the messages.

With images: the gateway pairs a language worker with encoders that share its transfer layout
(``routing.pair``: the language worker first, then only encoders whose rows fit its blocks),
creates a room (a random 63-bit id) and starts both halves at once — the encoder gets the
messages, the time the request has left and the prompt budget (the language worker's
``max_seq_len`` minus ``max_new_tokens``), the language worker the room, the encoder's transfer
endpoint and the sampling parameters. If the encoder refuses or is unreachable before anything
was transferred, the language half is cancelled (which frees its room) and the request is
retried on the next encoder with a fresh room. When every encoder tried was busy
(``RESOURCE_EXHAUSTED``: at its stream capacity or its queue full), the request waits — backing
off from 20 ms to 1 s, woken at once by a cancel — and tries again, for up to
``--encoder-busy-wait-s`` within its deadline: a burst above the encoders' capacity queues at
the gateway (bounded by ``--max-queued``) instead of failing. A busy language worker is treated
the same way (the next one, then waits up to ``--language-busy-wait-s``); one that is gone or
draining (``UNAVAILABLE`` before its first chunk) is marked unhealthy and the request goes to
the next (``--language-retries``).

Ids: every call to a worker carries an id the gateway draws itself (128 random bits per call). The
client's ``request_id`` only keys the admission table and is echoed in the answer, so no client
id can reach, replace or abort another request on a worker.

Cancellation: once an encoder accepted a room, the room is cancelled there (``Encoder.Cancel``,
best effort) when the request ends before the language worker streamed anything — the language
half refused or failed, the client cancelled, the deadline passed — so the encoder drops the
work and frees its blocks at once instead of at a transfer timeout. The first chunk from the
language worker means the transfer completed; from then on nothing is cancelled on the encoder.

A language worker that fails with ``UNAVAILABLE`` before it streamed anything (it died, it is
draining, nothing listens at its address) never showed the client a token: it is marked
unhealthy at once (the health poller brings it back when it answers) and the request is
dispatched again — a fresh room, the encoder again, whose embedding cache makes that cheap — to
the next language worker, up to ``--language-retries`` times.

The language stream is the request's single source of truth: every request ends with exactly
one terminal status.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import grpc

from protos.epd.v1 import common_pb2, gateway_pb2
from services.gateway import tools
from services.gateway import workers as calls
from services.gateway.admission import Admitted
from services.gateway.config import GatewayConfig
from services.gateway.errors import REQUEST_ABORTED, GatewayError
from services.gateway.keys import request_routing_key
from services.gateway.metrics import GatewayMetrics
from services.gateway.registry import Role, Worker, WorkerRegistry
from services.gateway.routing import BasePolicy, RoutingKey, no_pair_message, pair

RETRY_ENCODER_CODES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
)
# Encode refusals after which the encoder already failed the room itself (ALREADY_EXISTS: the
# room id is another request's, which must not be cancelled).
ENCODER_REFUSED_CODES = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
)


# A language worker's refusals before its first chunk after which the request goes elsewhere:
# it is gone or draining (marked unhealthy, ``--language-retries``), or busy (waited for).
NOT_STARTED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)

# Waits between rounds of workers that were all busy.
BUSY_BACKOFF_S = (0.02, 1.0)  # first, longest

# Final chunks after which the encoder may still hold the room (the transfer did not finish).
UNDELIVERED = (common_pb2.FINISH_REASON_ERROR, common_pb2.FINISH_REASON_ABORT)


def new_call_id() -> str:
    """The id of one call the gateway makes to a worker: 128 random bits, 32 hex digits."""
    return secrets.token_hex(16)


class EncoderRoom:
    """A room an encoder accepted. Cancelled there at most once, and never once delivered."""

    def __init__(self, encoder: Worker, room: int) -> None:
        self.encoder = encoder
        self.room = room
        self._open = True
        self._lock = threading.Lock()

    def delivered(self) -> None:
        """The language worker has the whole prompt: the encoder is done with the room."""
        with self._lock:
            self._open = False

    def cancel(self, reason: str) -> bool:
        """Ask the encoder to drop the room (non-blocking); False when delivered or done."""
        with self._lock:
            if not self._open:
                return False
            self._open = False
        calls.cancel_room(self.encoder, self.room, reason)
        return True


@dataclass(frozen=True)
class Job:
    """One admitted request on its way through dispatch: what every step of it needs."""

    request: gateway_pb2.GenerateRequest
    sampling: common_pb2.SamplingParams  # the request's, with the default max_new_tokens
    key: RoutingKey
    admitted: Admitted
    deadline: float  # time.monotonic()


@dataclass
class Dispatch:
    """The workers serving one request, and when it was sent to them."""

    language: Worker
    encoder: Worker | None
    sent_at: float
    call: object  # the language worker's streaming call
    room: EncoderRoom | None = None


class NotStarted(Exception):
    """The language worker failed before it streamed anything: the request may go elsewhere."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


def _status_from_rpc(exc: grpc.RpcError, who: str) -> GatewayError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.CANCELLED:  # not by the client (callers check): channel closed
        code = grpc.StatusCode.UNAVAILABLE
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        # the gateway's internal credentials were refused: not the client's key at fault
        return GatewayError(
            grpc.StatusCode.INTERNAL, f"internal credentials refused by {who}: {details}"
        )
    return GatewayError(code, f"{who}: {details}")


def max_seq_len(worker: Worker) -> int:
    """The longest prompt + completion ``worker`` takes; 0 when it does not say."""
    return int(worker.descriptor.get("max_seq_len", 0) or 0)


class Orchestrator:
    def __init__(
        self,
        config: GatewayConfig,
        registry: WorkerRegistry,
        encoder_policy: BasePolicy,
        language_policy: BasePolicy,
        metrics: GatewayMetrics,
    ) -> None:
        self.config = config
        self.registry = registry
        self.encoder_policy = encoder_policy
        self.language_policy = language_policy
        self.metrics = metrics

    # ---- entry point --------------------------------------------------------------------
    def run(
        self, request: gateway_pb2.GenerateRequest, admitted: Admitted, deadline: float
    ) -> Iterator[gateway_pb2.GenerateChunk]:
        """Stream the answer to a validated ``request``; raises ``GatewayError`` with the
        terminal status. Tools are written into its messages, calls parsed out of its answer
        (``tools.py``)."""
        chunks = self._run(with_tools(request), admitted, deadline)
        yield from tools.parse_tool_calls(chunks) if tools.uses_tools(request) else chunks

    def _run(
        self, request: gateway_pb2.GenerateRequest, admitted: Admitted, deadline: float
    ) -> Iterator[gateway_pb2.GenerateChunk]:
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        if not sampling.max_new_tokens:
            sampling.max_new_tokens = self.config.default_max_new_tokens
        key = request_routing_key(request)
        ordered, reason = self._order(Role.LANGUAGE, self.registry.healthy(Role.LANGUAGE), key)
        languages = self._fitting(ordered, sampling.max_new_tokens, request.sampling)
        job = Job(request, sampling, key, admitted, deadline)
        give_up_at = min(deadline, time.monotonic() + self.config.language_busy_wait_s)
        backoff = BUSY_BACKOFF_S[0]
        retries = 0
        busy: set[str] = set()  # workers that refused as busy since the last wait
        while True:
            dispatch = self._dispatch(job, languages)
            language = dispatch.language
            if retries:
                reason = "retry"
            elif language is not ordered[0]:  # the policy's choice cannot take it
                reason = "layout" if language is not languages[0] else "max_seq_len"
            self.metrics.routed("language", reason)
            self.language_policy.on_routed(language, key)
            try:
                yield from self._stream(dispatch, admitted, max(1, sampling.n))
                return
            except NotStarted as exc:
                if exc.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # busy, not broken: the next one; once all were, wait and go round again
                    languages = [w for w in languages if w is not language] + [language]
                    busy.add(language.address)
                    if all(w.address in busy for w in languages):
                        wait_s = min(backoff, give_up_at - time.monotonic())
                        if wait_s <= 0:
                            raise exc.error from None
                        self.metrics.routed("language", "busy_wait")
                        if admitted.wait_cancelled(wait_s):
                            raise GatewayError(grpc.StatusCode.CANCELLED, REQUEST_ABORTED) from None
                        backoff = min(2 * backoff, BUSY_BACKOFF_S[1])
                        busy.clear()
                    continue
                retries += 1
                self.registry.mark(language.address, False)
                languages = [w for w in languages if w is not language]
                out_of_time = admitted.cancelled or time.monotonic() >= deadline
                if not languages or out_of_time or retries > self.config.language_retries:
                    raise exc.error from None

    def _dispatch(self, job: Job, languages: list[Worker]) -> Dispatch:
        """Start the request on the first of ``languages`` (with an encoder of its layout when
        it has images)."""
        if not job.key.image_hashes:  # one per image: text only
            language = languages[0]
            self.metrics.routed("encoder", "text_only")
            r = job.request
            call = self._start_language(
                language,
                job.sampling,
                self._remaining(job.deadline),
                messages=r.messages,
                prompt_text=r.prompt_text,
                prompt_token_ids=r.prompt_token_ids,
                echo=r.echo,
            )
            job.admitted.on_cancel(call.cancel)  # Abort and client cancel reach the language worker
            return Dispatch(language, None, time.monotonic(), call)
        language, encoders = self._pair(languages, job.key)
        return self._dispatch_with_images(job, language, encoders)

    # ---- routing ------------------------------------------------------------------------
    def _order(
        self, role: Role, workers: list[Worker], key: RoutingKey
    ) -> tuple[list[Worker], str]:
        policy = self.encoder_policy if role == Role.ENCODER else self.language_policy
        ordered, reason = policy.choose(workers, key)
        if not ordered:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"no healthy {role.value} worker")
        return ordered, reason

    def _fitting(
        self, languages: list[Worker], max_new_tokens: int, asked: common_pb2.SamplingParams
    ) -> list[Worker]:
        """The language workers with room for ``max_new_tokens`` beside at least one prompt
        token (workers that do not advertise ``max_seq_len`` always qualify)."""
        fits = [w for w in languages if not max_seq_len(w) or max_seq_len(w) > max_new_tokens]
        if fits:
            return fits
        best = max(languages, key=max_seq_len)
        origin = "" if asked.max_new_tokens else " (the gateway's default)"
        raise GatewayError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"sampling.max_new_tokens is {max_new_tokens}{origin}, but the longest sequence a "
            f"language worker takes is max_seq_len {max_seq_len(best)} ({best.address}), "
            f"prompt included",
        )

    def _pair(self, languages: list[Worker], key: RoutingKey) -> tuple[Worker, list[Worker]]:
        """The preferred language worker that has encoders of its transfer layout, and those
        encoders in the encoder policy's order."""
        encoders = self.registry.healthy(Role.ENCODER)
        if not encoders:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "no healthy encoder worker")
        paired = pair(languages, encoders)
        if paired is None:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, no_pair_message(languages, encoders))
        language, fits = paired
        ordered, reason = self._order(Role.ENCODER, fits, key)
        self.metrics.routed("encoder", reason)
        return language, ordered

    def _remaining(self, deadline: float) -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        return remaining

    def _start_language(self, language: Worker, sampling, timeout_s: float, **kw):
        try:
            return calls.generate(
                language,
                new_call_id(),
                sampling,
                timeout_s,
                sessions=self.config.language_sessions,
                **kw,
            )
        except grpc.RpcError as exc:  # it left the pool since it was chosen
            raise _status_from_rpc(exc, f"language worker {language.address}") from None

    def _transfer_endpoint(self, encoder: Worker) -> str:
        endpoint = encoder.info.get("transfer_endpoint", "")
        if not endpoint:  # a static encoder not polled yet
            healthy, load, info, descriptor = calls.poll(encoder, timeout_s=2.0)
            self.registry.mark(encoder.address, healthy, load, info, descriptor)
            endpoint = info.get("transfer_endpoint", "")
        return endpoint

    def _dispatch_with_images(self, job: Job, language: Worker, encoders: list[Worker]) -> Dispatch:
        """Dispatch to the first encoder that accepts the room; while every one tried is busy,
        wait and go round again (see the module's docstring)."""
        give_up_at = min(job.deadline, time.monotonic() + self.config.encoder_busy_wait_s)
        backoff = BUSY_BACKOFF_S[0]
        while True:
            outcome = self._try_encoders(job, language, encoders)
            if isinstance(outcome, Dispatch):
                return outcome
            error = outcome
            wait_s = min(backoff, give_up_at - time.monotonic())
            if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED or wait_s <= 0:
                raise error
            self.metrics.routed("encoder", "busy_wait")
            if job.admitted.wait_cancelled(wait_s):
                raise GatewayError(grpc.StatusCode.CANCELLED, REQUEST_ABORTED)
            backoff = min(2 * backoff, BUSY_BACKOFF_S[1])

    def _try_encoders(
        self, job: Job, language: Worker, encoders: list[Worker]
    ) -> Dispatch | GatewayError:
        """One round over the encoders: the dispatch, or the error that ends the round — a
        busy encoder's ``RESOURCE_EXHAUSTED`` when there was one (waiting may help), else the
        last retriable failure."""
        budget = max_seq_len(language)
        max_prompt_tokens = budget - job.sampling.max_new_tokens if budget else 0
        last_error: GatewayError | None = None
        busy: GatewayError | None = None
        for attempt, encoder in enumerate(encoders[: 1 + self.config.encoder_retries]):
            if attempt:
                self.metrics.routed("encoder", "retry")
            endpoint = self._transfer_endpoint(encoder)
            if not endpoint:
                last_error = GatewayError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"encoder {encoder.address} has no transfer endpoint",
                )
                continue
            room = secrets.randbits(63) or 1
            timeout_s = self._remaining(job.deadline)
            call = self._start_language(
                language, job.sampling, timeout_s, room=room, encoder_endpoint=endpoint
            )
            job.admitted.on_cancel(call.cancel)
            try:
                encoded = calls.encode(
                    encoder, room, new_call_id(), job.request.messages, timeout_s, max_prompt_tokens
                )
                job.admitted.on_cancel(encoded.cancel)
                encoded.result()
            except (grpc.RpcError, grpc.FutureCancelledError) as exc:
                # NOTE: FutureCancelledError: the request was cancelled while Encode was in flight
                call.cancel()  # the language worker aborts the room and frees its blocks
                if job.admitted.cancelled:
                    calls.cancel_room(encoder, room, "request cancelled")
                    raise GatewayError(grpc.StatusCode.CANCELLED, REQUEST_ABORTED) from None
                last_error = _status_from_rpc(exc, f"encoder {encoder.address}")
                if last_error.code not in ENCODER_REFUSED_CODES:  # it may have accepted it
                    calls.cancel_room(encoder, room, f"encode call failed: {last_error.code.name}")
                if last_error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    busy = last_error
                if last_error.code in RETRY_ENCODER_CODES:
                    continue
                raise last_error from None
            accepted = EncoderRoom(encoder, room)
            job.admitted.on_cancel(partial(accepted.cancel, "request cancelled"))
            self.encoder_policy.on_routed(encoder, job.key)
            return Dispatch(language, encoder, time.monotonic(), call, accepted)
        assert last_error is not None
        return busy or last_error

    # ---- the answer ---------------------------------------------------------------------
    def _stream(
        self, dispatch: Dispatch, admitted: Admitted, num_choices: int
    ) -> Iterator[gateway_pb2.GenerateChunk]:
        """The language worker's chunks as the gateway's, until every one of the
        ``num_choices`` choices had its final chunk. Time to first token is the first token of
        any choice; inter-token latency is choice 0's; the end-to-end time is the last
        choice's finish."""
        start = admitted.admitted_at
        self.metrics.queue.observe(dispatch.sent_at - start)
        workers = [w for w in (dispatch.language, dispatch.encoder) if w is not None]
        for w in workers:
            self.registry.acquire(w)
        first_token_at = last_token_at = 0.0
        finished: set[int] = set()  # choices whose final chunk went out
        failure = "the request ended before the language worker answered"
        streamed = False
        try:
            for chunk in dispatch.call:
                streamed = True
                if dispatch.room is not None and chunk.finish_reason not in UNDELIVERED:
                    dispatch.room.delivered()  # a token or a normal finish: the prompt arrived
                now = time.monotonic()
                if chunk.token_ids and not first_token_at:
                    first_token_at = now
                    self.metrics.ttft.observe(now - start)
                if chunk.token_ids and chunk.index == 0:
                    if last_token_at:
                        self.metrics.itl.observe((now - last_token_at) / len(chunk.token_ids))
                    last_token_at = now
                out = gateway_pb2.GenerateChunk(
                    request_id=admitted.request_id,
                    index=chunk.index,
                    text=chunk.text,
                    token_ids=chunk.token_ids,
                    logprobs=chunk.logprobs,
                    prompt_logprobs=chunk.prompt_logprobs,
                    prompt_text=chunk.prompt_text,
                )
                if chunk.finish_reason == common_pb2.FINISH_REASON_ERROR:
                    failure = f"language worker failed: {chunk.error or 'error'}"
                    raise GatewayError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"language worker {dispatch.language.address}: {chunk.error or 'failed'}",
                    )
                if chunk.finish_reason == common_pb2.FINISH_REASON_ABORT:
                    failure = REQUEST_ABORTED
                    raise GatewayError(grpc.StatusCode.CANCELLED, REQUEST_ABORTED)
                if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    finished.add(chunk.index)
                    last = len(finished) >= num_choices
                    self._finalize(out, chunk, dispatch, start, first_token_at, last)
                    yield out
                    if last:
                        return  # the last final chunk ends the request, whatever the call does
                    continue
                yield out
        except grpc.RpcError as exc:
            if admitted.cancelled:
                failure = "request cancelled"
                raise GatewayError(grpc.StatusCode.CANCELLED, REQUEST_ABORTED) from None
            error = _status_from_rpc(exc, f"language worker {dispatch.language.address}")
            failure = f"language worker refused or failed: {error.code.name}"
            if not streamed and error.code in NOT_STARTED_CODES:
                raise NotStarted(error) from None
            raise error from None
        finally:
            if dispatch.room is not None:
                dispatch.room.cancel(failure)  # a no-op once the prompt was delivered
            for w in workers:
                self.registry.release(w)
            dispatch.call.cancel()

    def _finalize(
        self, out, chunk, dispatch: Dispatch, start: float, first_token_at: float, last: bool
    ):
        now = time.monotonic()
        out.finish_reason = chunk.finish_reason
        out.usage.prompt_tokens = chunk.usage.prompt_tokens
        out.usage.cached_tokens = chunk.usage.cached_tokens
        out.usage.completion_tokens = chunk.usage.completion_tokens
        lt, t = chunk.timing, out.timing
        t.queue_s = dispatch.sent_at - start
        t.encode_s = lt.encode_seconds
        t.transfer_s = lt.transfer_seconds
        t.prefill_s = lt.prefill_seconds
        t.first_token_s = (first_token_at - start) if first_token_at else 0.0
        t.total_s = now - start
        t.num_transfers = lt.num_transfers
        t.encoder_cache_hits = lt.num_encoder_cache_hits
        out.language = dispatch.language.address
        out.encoder = dispatch.encoder.address if dispatch.encoder is not None else ""
        if last:
            self.metrics.e2e.observe(now - start)


def with_tools(request: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateRequest:
    """``request`` as the workers take it: tools, calls and results written into its messages,
    and the grammar a forced ``tool_choice`` needs as its structured output (``request``
    itself when it uses no tools)."""
    if not (request.tools or any(m.role == "tool" or m.tool_calls for m in request.messages)):
        return request
    out = gateway_pb2.GenerateRequest()
    out.CopyFrom(request)
    del out.messages[:]
    out.messages.extend(tools.prompt_messages(request))
    grammar = tools.tool_grammar(request)
    if grammar:
        out.sampling.structured_output.grammar = grammar
    return out
