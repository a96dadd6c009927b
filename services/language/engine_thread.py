"""Runs a ``LanguageEngine`` on its own thread; gRPC threads talk to it through commands.

Every engine call happens on the engine thread. Callers get a ``queue.Queue`` per request onto
which each ``RequestOutput`` of that request is put; the last one has ``finished`` set.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from services.language.engine.engine import EngineLoad, LanguageEngine
from services.language.engine.request import FinishReason, RequestOutput
from services.language.engine.sampling import SamplingParams
from services.language.inputs import PromptInputs

logger = logging.getLogger(__name__)


INVALID_REQUEST = "invalid request: "  # prefix of errors raised while admitting a request


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting_requests``."""


@dataclass
class Submission:
    """A new request as the servicer hands it over (exactly one of messages / room)."""

    request_id: str
    params: SamplingParams
    messages: list[dict] | None = None
    inputs: PromptInputs | None = None
    room: int = 0
    encoder_endpoint: str = ""


class EngineThread:
    def __init__(self, engine: LanguageEngine, max_waiting: int) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, queue.Queue[RequestOutput]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._load = engine.load()
        self._num_pending = 0  # submitted, not yet seen by the engine thread
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="language-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def load(self) -> EngineLoad:
        return self._load

    def submit(self, sub: Submission) -> queue.Queue[RequestOutput]:
        """Queue ``sub``; raises QueueFullError when too many requests wait."""
        with self._lock:
            load = self._load
            if load.num_waiting + load.num_receiving + self._num_pending >= self.max_waiting:
                raise QueueFullError(f"{self.max_waiting} requests already waiting")
            self._num_pending += 1
            stream: queue.Queue[RequestOutput] = queue.Queue()
            self._streams[sub.request_id] = stream
        self._commands.put(lambda: self._add(sub, stream))
        self._wake.set()
        return stream

    def is_active(self, request_id: str) -> bool:
        """Whether ``request_id`` was submitted and has not finished."""
        with self._lock:
            return request_id in self._streams

    def abort(self, request_id: str) -> None:
        self._commands.put(lambda: self._dispatch([self.engine.abort(request_id)]))
        self._wake.set()

    def _add(self, sub: Submission, stream: queue.Queue[RequestOutput]) -> None:
        with self._lock:
            self._num_pending -= 1
        try:
            inputs = sub.inputs
            if sub.messages is not None:
                inputs = self.engine.tokenize_messages(sub.messages)
            self.engine.add_request(
                sub.request_id, sub.params, inputs, sub.room, sub.encoder_endpoint
            )
        except Exception as exc:  # a bad request must not take the engine down
            with self._lock:
                self._streams.pop(sub.request_id, None)
            error = INVALID_REQUEST + str(exc)
            stream.put(RequestOutput(sub.request_id, [], "", FinishReason.ERROR, error=error))

    def _dispatch(self, outputs: list[RequestOutput | None]) -> None:
        for out in outputs:
            if out is None:
                continue
            with self._lock:
                stream = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
            if stream is not None:
                stream.put(out)

    def _loop(self) -> None:
        while not self._stop.is_set():
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
            if self.engine.has_work():
                try:
                    self._dispatch(self.engine.step())
                except Exception:
                    logger.exception("engine step failed; aborting every request")
                    for rid in list(self.engine.requests):
                        out = self.engine.abort(rid)
                        if out is not None:
                            out.finish_reason, out.error = FinishReason.ERROR, "engine error"
                        self._dispatch([out])
            else:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
            self._load = self.engine.load()
