"""Runs a ``LanguageEngine`` on its own thread; gRPC threads talk to it through an inbox.

Every engine call happens on the engine thread. Each request's outputs go to a sink (an
``OutputSink``): by default a ``RequestStream`` of its own, a queue its caller blocks on; or one
a caller shares between requests (a session, ``services/language/sessions.py``). Each step hands
every sink its outputs of that step in one ``put_all`` (of every choice, each with its
``index``); a request's last output has ``ends_request`` set, and every submitted request gets
one (at shutdown too), so a caller may block on its sink.

The thread never polls. It sleeps on a condition until there is something to do: a command in
the inbox (a new request, an abort, stop), a room that ended (the embedding source's listener),
or runnable work. Runnable means the engine has queued or running requests and the last step
made progress; a step that scheduled nothing changes nothing until one of the other events, so
the thread sleeps then too. A request that only waits for its embeddings costs no CPU.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

from services.language.engine.engine import LanguageEngine
from services.language.engine.grammar import Guide
from services.language.engine.outputs import EngineLoad
from services.language.engine.request import ErrorKind, FinishReason, RequestError, RequestOutput
from services.language.engine.sampling import SamplingParams
from services.language.inputs import PromptInputs

logger = logging.getLogger(__name__)

SHUTDOWN_ERROR = "the language worker is shutting down"


class OutputSink(Protocol):
    def put_all(self, outputs: list[RequestOutput]) -> None:
        """Take outputs of one step, in order (called on the engine thread: must not block)."""


class RequestStream(queue.Queue):
    """One request's outputs, for a caller that blocks on them (``coalesced_outputs``)."""

    def put_all(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.put(out)


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting_requests``."""


class EngineStoppedError(RuntimeError):
    """The engine thread is stopping: no new requests."""


class DuplicateRequestError(ValueError):
    """A request with this id is still in flight."""


@dataclass
class Submission:
    """A new request as the servicer hands it over (exactly one of messages, prompt_text,
    prompt_token_ids, inputs, room)."""

    request_id: str
    params: SamplingParams
    messages: list[dict] | None = None
    prompt_text: str | None = None  # a raw prompt, tokenized without the chat template
    prompt_token_ids: list[int] | None = None
    inputs: PromptInputs | None = None
    room: int = 0
    encoder_endpoint: str = ""
    deadline: float | None = None  # the caller's (time.monotonic clock)
    guide: Guide | None = None  # structured output's, made on the caller's thread


class EngineThread:
    def __init__(self, engine: LanguageEngine, max_waiting: int) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._lock = threading.Lock()  # guards everything below; never held calling the engine
        self._wake = threading.Condition(self._lock)
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self._rooms_ready = False  # the embedding source has rooms to collect
        self._stopping = False
        self._idle = threading.Condition(self._lock)  # notified when no request is in flight
        self._streams: dict[str, OutputSink] = {}
        self._num_pending = 0  # submitted, not yet seen by the engine thread
        self._load = engine.load()
        if engine.embedding_source is not None:
            engine.embedding_source.listen(self._on_rooms_ready)
        self._thread = threading.Thread(target=self._loop, name="language-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Finish every request (``SHUTDOWN_ERROR``) and end the thread."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def load(self) -> EngineLoad:
        return self._load

    def submit(self, sub: Submission, sink: OutputSink | None = None) -> OutputSink:
        """Queue ``sub``, its outputs going to ``sink`` (a new ``RequestStream`` when None),
        which it returns; raises QueueFullError, DuplicateRequestError or EngineStoppedError.

        A chat or a raw prompt is tokenized, and a structured output compiled, here, on the
        caller's thread, so that the engine thread spends no step time on chat templates or
        grammars; a prompt that cannot be tokenized or a grammar that cannot be compiled ends
        its request alone (its stream gets the error)."""
        stream: OutputSink = sink if sink is not None else RequestStream()
        failure = None
        try:
            sub = self._tokenized(sub)
            if sub.params.structured is not None:
                sub = replace(sub, guide=self.engine.grammars.guide(sub.params.structured))
        except Exception as exc:  # a bad prompt or grammar must not take anything else down
            failure = exc
        with self._lock:
            if self._stopping:
                raise EngineStoppedError(SHUTDOWN_ERROR)
            if sub.request_id in self._streams:
                raise DuplicateRequestError(f"request id {sub.request_id!r} is already in use")
            load = self._load
            if load.num_waiting + load.num_receiving + self._num_pending >= self.max_waiting:
                raise QueueFullError(f"{self.max_waiting} requests already waiting")
            if failure is None:
                self._num_pending += 1
                self._streams[sub.request_id] = stream
                self._post(lambda: self._add(sub, stream))
        if failure is not None:
            stream.put_all([_error_output(sub.request_id, failure)])
        return stream

    def _tokenized(self, sub: Submission) -> Submission:
        """``sub`` with its chat or raw prompt turned into inputs."""
        if sub.messages is not None:
            return replace(sub, inputs=self.engine.tokenize_messages(sub.messages), messages=None)
        if sub.prompt_text is not None:
            return replace(
                sub, inputs=self.engine.tokenize_prompt(sub.prompt_text), prompt_text=None
            )
        if sub.prompt_token_ids is not None:
            inputs = self.engine.prompt_of_ids(sub.prompt_token_ids)
            return replace(sub, inputs=inputs, prompt_token_ids=None)
        return sub

    @property
    def num_active(self) -> int:
        """Requests submitted and not finished."""
        with self._lock:
            return len(self._streams)

    def wait_idle(self, deadline: float) -> bool:
        """Block until no request is in flight (True) or ``deadline`` (``time.monotonic``)
        passes (False)."""
        with self._idle:
            return self._idle.wait_for(
                lambda: not self._streams, max(0.0, deadline - time.monotonic())
            )

    def is_active(self, request_id: str) -> bool:
        """Whether ``request_id`` was submitted and has not finished."""
        with self._lock:
            return request_id in self._streams

    def abort(self, request_id: str, stream: OutputSink | None = None) -> None:
        """Abort ``request_id`` (only while its output goes to ``stream``, when given)."""
        with self._lock:
            if stream is not None and self._streams.get(request_id) is not stream:
                return  # finished already, or the id now names another request
            self._post(lambda: self._dispatch(self.engine.abort(request_id)))

    # ---- the engine thread --------------------------------------------------------------
    def _post(self, command: Callable[[], None]) -> None:
        """Queue a command for the engine thread (lock held)."""
        self._inbox.append(command)
        self._wake.notify()

    def _on_rooms_ready(self) -> None:
        """The embedding source's listener: runs on its thread, must not block."""
        with self._lock:
            self._rooms_ready = True
            self._wake.notify()

    def _add(self, sub: Submission, stream: OutputSink) -> None:
        with self._lock:
            self._num_pending -= 1
        try:
            self.engine.add_request(
                sub.request_id,
                sub.params,
                sub.inputs,
                sub.room,
                sub.encoder_endpoint,
                sub.deadline,
                sub.guide,
            )
        except Exception as exc:  # a bad request must not take the engine down
            with self._lock:
                self._forget(sub.request_id)
            stream.put_all([_error_output(sub.request_id, exc)])

    def _forget(self, request_id: str) -> None:
        """``request_id`` is no longer in flight (lock held)."""
        self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.notify_all()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand each sink its outputs among ``outputs``, in one ``put_all``."""
        by_sink: dict[int, tuple[OutputSink, list[RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if out.ends_request:
                    self._forget(out.request_id)
                if stream is not None:
                    by_sink.setdefault(id(stream), (stream, []))[1].append(out)
        for stream, outs in by_sink.values():
            stream.put_all(outs)

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as exc:  # a defect in the engine itself: fail what it holds, go on
            logger.exception("engine step failed; failing every request")
            error = f"engine error: {type(exc).__name__}: {exc}"
            return [
                out for rid in list(self.engine.requests) for out in self.engine.abort(rid, error)
            ]

    def _guarded(self, action: Callable[[], None]) -> None:
        """Run ``action``; a defect in it is logged and the thread goes on serving."""
        try:
            action()
        except Exception:
            logger.exception("engine thread action failed")

    def _loop(self) -> None:
        runnable = False
        while True:
            with self._lock:
                while not (self._inbox or self._rooms_ready or self._stopping or runnable):
                    self._wake.wait()
                if self._stopping:
                    break
                commands, self._inbox = self._inbox, collections.deque()
                rooms_ready, self._rooms_ready = self._rooms_ready, False
            for command in commands:
                self._guarded(command)
            if rooms_ready:
                self._guarded(lambda: self._dispatch(self.engine.collect_embeddings()))
            runnable = False
            if self.engine.has_work():
                num_batches = self.engine.num_batches
                self._dispatch(self._step())
                runnable = self.engine.num_batches != num_batches  # it made progress
            self._load = self.engine.load()
        self._shut_down()

    def _shut_down(self) -> None:
        """Every request gets its last output: engine requests and never-added submissions."""
        for rid in list(self.engine.requests):
            self._dispatch(self.engine.abort(rid, SHUTDOWN_ERROR))
        with self._lock:
            left, self._streams = self._streams, {}
            self._idle.notify_all()
            self._inbox.clear()
        for rid, stream in left.items():
            stream.put_all(
                [
                    RequestOutput(
                        rid,
                        [],
                        "",
                        FinishReason.ERROR,
                        error=SHUTDOWN_ERROR,
                        error_kind=ErrorKind.FAILED,
                    )
                ]
            )
        self._load = self.engine.load()
        self.engine.grammars.close()


def _error_output(request_id: str, exc: Exception) -> RequestOutput:
    """The last output of a request that could not be taken in."""
    kind = exc.kind if isinstance(exc, RequestError) else ErrorKind.INVALID_ARGUMENT
    return RequestOutput(request_id, [], "", FinishReason.ERROR, error=str(exc), error_kind=kind)


def coalesced_outputs(stream: RequestStream) -> Iterator[RequestOutput]:
    """A request's outputs as its caller should send them: blocks for the next one, then merges
    into it every later output of the same choice already queued behind it (their tokens, text
    and log-probabilities in order; the last one's finish and usage). A caller that sends slower
    than the engine decodes thus sends fewer, larger messages instead of falling further behind.
    An error is never merged, nor are outputs of different choices (``index``): the output
    before goes out first. Ends after the request's last output (``ends_request``)."""
    pending: RequestOutput | None = None
    while True:
        out, pending = pending or stream.get(), None
        while not out.finished:
            try:
                nxt = stream.get_nowait()
            except queue.Empty:
                break
            if nxt.error_kind != ErrorKind.NONE or nxt.index != out.index:
                pending = nxt
                break
            out = _merged(out, nxt)
        yield out
        if out.ends_request:
            return


def coalesced(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """``outputs`` (several requests', in order) with each merged into the latest one before it
    of the same request and choice, as ``coalesced_outputs`` merges (never an error, never
    into a finished one): a session sends one chunk per choice and step, however many steps
    its stream fell behind."""
    merged: list[RequestOutput] = []
    latest: dict[tuple[str, int], int] = {}  # (request, choice) -> its position in merged
    for out in outputs:
        key = (out.request_id, out.index)
        at = latest.get(key)
        prev = merged[at] if at is not None else None
        failed = ErrorKind.NONE != out.error_kind or (prev and prev.error_kind != ErrorKind.NONE)
        if prev is None or prev.finished or failed:
            latest[key] = len(merged)
            merged.append(out)
        else:
            merged[at] = _merged(prev, out)
    return merged


def _merged(out: RequestOutput, nxt: RequestOutput) -> RequestOutput:
    """``nxt`` with ``out``'s tokens, text and log-probabilities before its own."""
    return replace(
        nxt,
        token_ids=out.token_ids + nxt.token_ids,
        text=out.text + nxt.text,
        logprobs=out.logprobs + nxt.logprobs,
        prompt_logprobs=out.prompt_logprobs + nxt.prompt_logprobs,
    )
