"""The ASGI response of one completion (chat or legacy): JSON or Server-Sent Events, watching
the client. What the JSON and the events hold is the ``AnswerWriter``'s (``replies.py`` for chat,
``completions.py`` for legacy completions).

While the answer is produced, a watcher task reads the connection's ASGI events; when the
client disconnects (``http.disconnect``) it closes the ``ChunkPump``, which cancels the request
on both workers within the event loop's next turn, whether the request is still waiting for its
first token or streaming. The status line is sent only once the first chunk arrived, so a
request refused before it produced anything (no worker, queue full at a worker, deadline) gets
its own HTTP status and OpenAI error JSON, streamed or not; an error after the stream began is
an error event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from protos.epd.v1 import gateway_pb2
from services.gateway.errors import GatewayError
from services.gateway.http.bridge import ChunkPump, Closed
from services.gateway.http.convert import FieldNames
from services.gateway.http.errors import HttpError, from_gateway
from services.gateway.http.replies import DONE, dumps, event

log = logging.getLogger(__name__)


class AnswerWriter(Protocol):
    """One answer's shapes: its object when not streamed, its events when streamed."""

    def unary(self, chunks: list[gateway_pb2.GenerateChunk]) -> dict:
        """The answer's object from all of its chunks (the last one final)."""
        ...

    def write(self, chunk: gateway_pb2.GenerateChunk) -> bytes:
        """The events of one more chunk (possibly none)."""
        ...


JSON_TYPE = (b"content-type", b"application/json")
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies: pass events on as they come
]


async def _watch(receive: Receive, pump: ChunkPump) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            pump.close()
            return


def _internal(exc: BaseException) -> HttpError:
    log.exception("completion failed", exc_info=exc)
    return HttpError(500, "internal error", "server_error", None, "internal")


class AnswerResponse(Response):
    """One completion's answer (an ASGI app, returned by the endpoint)."""

    def __init__(
        self,
        pump: ChunkPump,
        writer: AnswerWriter,
        names: FieldNames,
        stream: bool,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__()  # status and headers are sent by __call__ itself
        self.pump = pump
        self.writer = writer
        self.names = names
        self.stream = stream
        self.extra_headers = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(_watch(receive, self.pump))
        try:
            if self.stream:
                await self._stream(send)
            else:
                await self._unary(send)
        except Closed:
            pass  # the client is gone: nothing to send
        finally:
            watcher.cancel()
            self.pump.close()  # a no-op once the answer ended

    async def _send(self, send: Send, status: int, headers: list, body: bytes, more=False):
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": more})

    async def _error(self, send: Send, error: HttpError) -> None:
        extra = [(k.encode(), v.encode()) for k, v in error.headers().items()]
        headers = [JSON_TYPE, *self.extra_headers, *extra]
        await self._send(send, error.status, headers, error.encoded())

    async def _unary(self, send: Send) -> None:
        chunks, final = [], None
        try:
            while (chunk := await self.pump.next()) is not None:
                chunks.append(chunk)
                if chunk.finish_reason:
                    final = chunk
        except GatewayError as exc:
            return await self._error(send, from_gateway(exc, self.names))
        except Closed:
            raise
        except Exception as exc:
            return await self._error(send, _internal(exc))
        if final is None:
            return await self._error(send, _internal(RuntimeError("answer without an end")))
        body = dumps(self.writer.unary(chunks))
        await self._send(send, 200, [JSON_TYPE, *self.extra_headers], body)

    async def _stream(self, send: Send) -> None:
        try:
            chunk = await self.pump.next()
        except GatewayError as exc:
            return await self._error(send, from_gateway(exc, self.names))
        except Closed:
            raise
        except Exception as exc:
            return await self._error(send, _internal(exc))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*SSE_HEADERS, *self.extra_headers]})  # fmt: skip
        writer = self.writer
        tail = DONE
        try:
            while chunk is not None:
                data = writer.write(chunk)
                if data:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                chunk = await self.pump.next()
        except GatewayError as exc:
            tail = event(from_gateway(exc, self.names).body()) + DONE
        except Closed:
            raise
        except Exception as exc:
            tail = event(_internal(exc).body()) + DONE
        await send({"type": "http.response.body", "body": tail, "more_body": False})
