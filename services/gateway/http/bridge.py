"""From the gateway's blocking chunk iterator to the event loop, without blocking the loop.

The orchestrator is synchronous (blocking gRPC iterators). ``ChunkPump`` iterates one request's
``FrontDoor.run`` on a thread of the HTTP server's pool and hands each chunk to the event loop
(``call_soon_threadsafe`` into an ``asyncio.Queue``); the request's coroutine awaits them.

``close()`` (the client went away, or the coroutine was cancelled) cancels the request at once
(``Admitted.cancel``: both workers drop it) and wakes the coroutine; the thread then sees the
request end, stops iterating and closes the iterator, which counts the outcome and frees the
admission slot. Nothing is left behind whichever side stops first.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor

from protos.epd.v1 import gateway_pb2


class Closed(Exception):
    """The pump was closed before the answer ended."""


_END = object()


class ChunkPump:
    def __init__(
        self,
        chunks: Iterator[gateway_pb2.GenerateChunk],
        cancel: Callable[[], object],
        executor: Executor,
    ) -> None:
        """Start iterating ``chunks`` on ``executor``; ``cancel`` ends the request early."""
        self._chunks = chunks
        self._cancel = cancel
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._closed = threading.Event()
        self._ended = False  # next() saw the end or an error: nothing left to cancel
        executor.submit(self._pump)

    def _put(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is gone (server stopped): nobody is waiting
            pass

    def _pump(self) -> None:
        try:
            for chunk in self._chunks:
                if self._closed.is_set():
                    break
                self._put(chunk)
        except BaseException as exc:  # handed to the coroutine, which raises it
            self._put(exc)
        else:
            self._put(_END)
        finally:
            close = getattr(self._chunks, "close", None)
            if close is not None:
                close()  # ends FrontDoor.run: outcome counted, admission slot freed

    async def next(self) -> gateway_pb2.GenerateChunk | None:
        """The next chunk; None at the end. Raises what the iterator raised, or ``Closed``."""
        item = await self._queue.get()
        if item is _END:
            self._ended = True
            return None
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        return item

    def close(self) -> None:
        """Cancel the request unless it ended (idempotent); a waiting ``next`` raises
        ``Closed``."""
        if self._closed.is_set() or self._ended:
            return
        self._closed.set()
        self._cancel()
        self._queue.put_nowait(Closed())

    @property
    def closed(self) -> bool:
        return self._closed.is_set()


class MergedPump:
    """Several requests' pumps as one (a legacy completion of several prompts): ``next`` gives
    the next chunk any of them produced, None once all ended; an error from one closes the
    others and is raised; ``close`` closes them all (a waiting ``next`` raises ``Closed``).
    Chunks tell their request apart by ``request_id``."""

    def __init__(self, pumps: list[ChunkPump]) -> None:
        self._pumps = pumps
        self._waiting: dict[asyncio.Future, int] = {}  # each live pump's next(), by position
        for i in range(len(pumps)):
            self._arm(i)
        self._closed = False

    def _arm(self, i: int) -> None:
        self._waiting[asyncio.ensure_future(self._pumps[i].next())] = i

    async def next(self) -> gateway_pb2.GenerateChunk | None:
        while self._waiting:
            done, _ = await asyncio.wait(self._waiting, return_when=asyncio.FIRST_COMPLETED)
            if self._closed:
                raise Closed()
            task = min(done, key=self._waiting.__getitem__)  # the first prompt's first
            i = self._waiting.pop(task)
            try:
                chunk = task.result()
            except BaseException:
                self.close()
                raise
            if chunk is not None:
                self._arm(i)
                return chunk
        return None

    def close(self) -> None:
        """Close every pump (a no-op for those that ended) and drop what they would give."""
        self._closed = True
        for pump in self._pumps:
            pump.close()
        for task in self._waiting:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: nobody will read it
            else:
                task.cancel()
        self._waiting.clear()
