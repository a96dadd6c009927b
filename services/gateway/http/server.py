"""The HTTP server beside the gateway's gRPC servers: uvicorn on an event loop of its own thread.

``HttpServer.start`` binds the port in the calling thread (a busy port is an ``OSError`` naming
it, as for every other port of the project), builds the TLS context when configured (a bad file
is an error at start-up), then serves on a thread that runs its own event loop (uvloop and
httptools, as uvicorn's standard install uses). The loop sleeps until a connection or
``stop()`` wakes it. ``stop(grace_s)`` stops accepting, lets requests in flight finish within
``grace_s`` (then cancels them: their requests are cancelled on the workers) and joins.

Each request's blocking part runs on ``executor`` (``bridge.py``); ``HttpServer`` owns it and
shuts it down after the loop ended.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import uvicorn
from starlette.types import ASGIApp

from common.auth import BearerKeys
from common.tls import ServerTLS
from services.gateway.config import GatewayConfig
from services.gateway.frontdoor import FrontDoor
from services.gateway.http.app import HttpContext, create_app
from services.gateway.http.dashboard import DashboardSampler
from services.gateway.http.tls import server_context
from services.gateway.registry import WorkerRegistry

log = logging.getLogger(__name__)
MIN_GRACE_S = 0.5  # closing idle keep-alive connections takes uvicorn a moment


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: a free port); ``OSError`` naming it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT only, not a 2nd
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind HTTP port {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


class HttpServer:
    def __init__(
        self,
        app: ASGIApp,
        host: str,
        port: int,
        executor: ThreadPoolExecutor,
        tls: ServerTLS | None = None,
    ) -> None:
        self._sock = bind(host, port)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self.tls = tls
        self._executor = executor
        config = uvicorn.Config(
            app,
            lifespan="off",
            loop="uvloop",
            http="httptools",
            ws="none",
            log_level="warning",
            access_log=False,
            server_header=False,
            date_header=False,
        )
        try:
            config.load()
            if tls is not None:
                config.ssl = server_context(tls)
        except BaseException:
            self._sock.close()
            raise
        self._config = config
        self._server = uvicorn.Server(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="http-server", daemon=True)

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def start(self) -> HttpServer:
        """Serve; returns once the server accepts connections (raises what stopped it)."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        loop = self._config.get_loop_factory()()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # start-up failed: start() re-raises it
            self._error = exc
            log.exception("HTTP server stopped")
        finally:
            self._ready.set()
            loop.close()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = self._server
        server.lifespan = self._config.lifespan_class(self._config)
        await server.startup(sockets=[self._sock])
        self._ready.set()
        await self._stop.wait()
        await server.shutdown(sockets=[self._sock])

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop accepting, give requests in flight ``grace_s``, then end them; join."""
        self._config.timeout_graceful_shutdown = max(grace_s, MIN_GRACE_S)
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop already ended
                pass
        self._thread.join(timeout=grace_s + 10)
        self._sock.close()
        self._executor.shutdown(wait=True)


@dataclass
class HttpService:
    """The HTTP front door of a gateway: its server and what the app serves from."""

    server: HttpServer
    context: HttpContext

    def stop(self, grace_s: float = 2.0) -> None:
        self.context.stopping.set()  # /health says so while requests finish
        self.server.stop(grace_s)
        if self.context.dashboard is not None:
            self.context.dashboard.stop()


def start_http(
    config: GatewayConfig,
    front_door: FrontDoor,
    registry: WorkerRegistry,
    keys: BearerKeys | None,
    tls: ServerTLS | None,
) -> HttpService:
    """Serve the HTTP API (and the status page) on ``config.http_host or config.host``
    : ``config.http_port``, with the public port's TLS and API keys."""
    executor = ThreadPoolExecutor(config.max_queued + 4, thread_name_prefix="http-request")
    dashboard = None
    if config.dashboard:
        dashboard = DashboardSampler(
            registry,
            front_door.metrics,
            front_door.admission,
            config.dashboard_sample_s,
            config.dashboard_history_s,
        )
    context = HttpContext(config, front_door, registry, executor, keys, dashboard)
    host = config.http_host or config.host
    try:
        server = HttpServer(create_app(context), host, config.http_port, executor, tls).start()
    except BaseException:
        if dashboard is not None:
            dashboard.stop()
        executor.shutdown(wait=False)
        raise
    return HttpService(server, context)
