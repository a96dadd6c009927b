"""``RequestTable``: the engine's requests in flight, and the one way each of them ends.

Owned by the engine (one thread; see ``engine.py``). It holds three maps:

* ``requests``: request id -> its choice 0, while any choice of it is going;
* ``choices``: request id -> every choice of it, by index (the same lifetime);
* ``receiving``: room -> the request (choice 0) whose prompt still arrives from an encoder.

Every choice ends through ``finish`` (``end_request`` ends all of a request's choices still
going, ``fail`` does so with an error): it leaves the scheduler, a normal finish (STOP, LENGTH)
puts its prefix into the radix cache, and a room still in flight is aborted at the embedding
source. When the request's last choice finished, the request leaves ``requests`` and
``choices`` and its delivered room is released (its image rows may be views of the room's
transfer blocks, so not before).
"""

from __future__ import annotations

from services.language.engine.cache_manager import CacheManager
from services.language.engine.outputs import request_output
from services.language.engine.request import (
    ErrorKind,
    FinishReason,
    Request,
    RequestError,
    RequestOutput,
    RequestStatus,
)
from services.language.engine.scheduler import Scheduler
from services.language.receiving import EmbeddingSource

NORMAL_FINISH = (FinishReason.STOP, FinishReason.LENGTH)
RUNNING = (RequestStatus.PREFILL, RequestStatus.DECODE)
NOT_SCHEDULED = (RequestStatus.WAITING_FOR_EMBEDDINGS, RequestStatus.WAITING_FOR_FIRST_CHOICE)


class RequestTable:
    def __init__(
        self,
        scheduler: Scheduler,
        cache_manager: CacheManager,
        embedding_source: EmbeddingSource | None,
    ) -> None:
        self.scheduler = scheduler
        self.cache_manager = cache_manager
        self.embedding_source = embedding_source
        self.requests: dict[str, Request] = {}  # choice 0 of each request in flight
        self.choices: dict[str, list[Request]] = {}  # every choice of it, by index
        self.receiving: dict[int, Request] = {}  # room -> request waiting for embeddings

    def add(self, choices: list[Request]) -> None:
        """A new request's choices (by index) are in flight."""
        self.requests[choices[0].request_id] = choices[0]
        self.choices[choices[0].request_id] = choices

    def wait_for_room(
        self, req: Request, room: int, encoder_endpoint: str, deadline: float | None
    ) -> None:
        """``req`` (choice 0) waits for ``room``'s prompt, pulled from the encoder at
        ``encoder_endpoint`` by the embedding source (when there is one) until ``deadline``.
        RequestError (INVALID_ARGUMENT) for no room or one in use."""
        if not room:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, "a request needs inputs or a room")
        if room in self.receiving:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"room {room} is already in use")
        if self.embedding_source is not None:
            self.embedding_source.add_room(room, encoder_endpoint, deadline)
        req.status = RequestStatus.WAITING_FOR_EMBEDDINGS
        self.receiving[room] = req

    def take_room(self, room: int) -> Request | None:
        """The request whose ``room``'s prompt arrived in full (or failed), no longer
        receiving; None when it was aborted meanwhile (the room is released: nobody will use
        its inputs)."""
        req = self.receiving.pop(room, None)
        if req is None:
            self.release_room(room)
        return req

    def start_other_choices(self, first: Request) -> None:
        """``first`` (choice 0) put its prompt into the radix cache: the choices waiting for it
        take its prompt and go to the front of the queue (they reuse its prefill)."""
        waiting = [
            c
            for c in self.choices.get(first.request_id, ())
            if c.status == RequestStatus.WAITING_FOR_FIRST_CHOICE
        ]
        for choice in waiting:
            choice.share_prompt(first)
        self.scheduler.add_first(waiting)

    def fail(self, req: Request, kind: ErrorKind, error: str) -> list[RequestOutput]:
        """``req`` failed: its request ends, every choice with the error."""
        return self.end_request(req, FinishReason.ERROR, error, kind)

    def end_request(
        self,
        req: Request,
        reason: FinishReason,
        error: str = "",
        error_kind: ErrorKind = ErrorKind.NONE,
    ) -> list[RequestOutput]:
        """Finish every choice of ``req``'s request still going (``req`` last), with ``reason``."""
        choices = self.choices_of(req)
        going = [c for c in choices if c is not req and c.status != RequestStatus.FINISHED]
        if req.status != RequestStatus.FINISHED:
            going.append(req)
        return [self.finish(c, reason, error=error, error_kind=error_kind) for c in going]

    def finish(
        self,
        req: Request,
        reason: FinishReason,
        token_ids: list[int] | None = None,
        text: str = "",
        error: str = "",
        error_kind: ErrorKind = ErrorKind.NONE,
    ) -> RequestOutput:
        """End the choice ``req`` with ``reason``; its last output carries ``token_ids`` and
        ``text`` (the token that ended it, if any)."""
        if req.status in RUNNING and reason in NORMAL_FINISH:
            self.cache_manager.cache_prefix(req)
        if req.status not in NOT_SCHEDULED:
            self.scheduler.remove(req)
        if self.receiving.get(req.room) is req:  # its room is still in flight: drop it
            del self.receiving[req.room]
            if self.embedding_source is not None:
                self.embedding_source.abort(req.room)
            req.room = 0  # nothing was delivered: nothing to release
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        out = request_output(req, token_ids or [], text, error, error_kind)
        choices = self.choices_of(req)
        out.more_choices = any(c.status != RequestStatus.FINISHED for c in choices)
        if not out.more_choices:  # the request's last choice: the request ends
            if self.requests.get(req.request_id) is choices[0]:
                del self.requests[req.request_id]
                self.choices.pop(req.request_id, None)
            self.release_room(choices[0].room)
        return out

    def choices_of(self, req: Request) -> list[Request]:
        """Every choice of ``req``'s request, by index (``[req]`` once its request ended)."""
        choices = self.choices.get(req.request_id, [])
        return choices if any(c is req for c in choices) else [req]

    def release_room(self, room: int) -> None:
        """Give a delivered room's transfer blocks back (its image rows may be views of them)."""
        if room and self.embedding_source is not None:
            self.embedding_source.release(room)
