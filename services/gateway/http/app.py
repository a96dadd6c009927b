"""The HTTP front door: OpenAI's chat and legacy completions and models, health, the status page.

Routes:
* ``POST /v1/chat/completions`` and ``POST /v1/completions`` (a raw prompt: text or token ids;
  both streamed with ``stream: true``), ``GET /v1/models``,
  ``GET /v1/models/{model}`` — API key required when keys are configured (``guard.py``);
* ``GET /health`` — 200 while serving, 503 once stopping; the pools' health counts;
* ``GET /dashboard``, ``GET /dashboard/state``, ``GET /dashboard/static/{file}`` — the status page
  (``dashboard.py``; off with ``--no-dashboard``);
* ``GET /openapi.json``. No ``/docs``: its UI would load scripts from a CDN.

A chat completion is translated into a ``GenerateRequest`` (``convert.py``), admitted through
``FrontDoor.admit`` in the event loop (validation and admission are short and never block), and
answered by ``FrontDoor.run`` iterated on a thread of the server's pool (``bridge.py``), so the
event loop never waits on a worker. Every error is OpenAI's JSON shape (``errors.py``).
Optional request headers: ``X-Request-Id`` (the request's id, as gRPC's ``request_id``; the
answer's ``id`` is ``chatcmpl-<id>``) and ``X-Request-Timeout`` (seconds, as a gRPC deadline;
at most the gateway's ``default_timeout_s``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from threading import Event
from typing import Annotated

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp

from common.auth import BearerKeys
from common.drain import Readiness
from protos.epd.v1 import gateway_pb2
from services.gateway.config import GatewayConfig
from services.gateway.errors import GatewayError
from services.gateway.frontdoor import Api, FrontDoor
from services.gateway.http import schemas
from services.gateway.http.bridge import ChunkPump, MergedPump
from services.gateway.http.choices import ChoicesWriter
from services.gateway.http.completion_replies import CompletionWriter
from services.gateway.http.completions import prompt_only, to_completion_requests
from services.gateway.http.convert import (
    FieldNames,
    check_model,
    model_not_found,
    to_generate_request,
)
from services.gateway.http.dashboard import DashboardSampler
from services.gateway.http.errors import HttpError, from_gateway, invalid, outcome_of, status_error
from services.gateway.http.guard import Guard, key_problem
from services.gateway.http.json_body import JsonBodyRoute
from services.gateway.http.replies import ChunkWriter, Head, dumps
from services.gateway.http.responses import AnswerResponse, AnswerWriter
from services.gateway.registry import ROLES, Role, WorkerRegistry
from services.gateway.servicer import identity

# Optional headers of both completion routes (see the module's docstring).
RequestIdHeader = Annotated[str | None, Header(description="the request's id")]
TimeoutHeader = Annotated[float | None, Header(description="seconds the request may take")]
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
COUNTED_PATHS = (CHAT_PATH, COMPLETIONS_PATH)  # requests counted in the gateway's series
OWNER = "epd-serve"
STATIC = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
PAGE_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
ERRORS = {status: {"model": schemas.ErrorResponse} for status in (400, 401, 404, 413, 500)}
CHAT_RESPONSES = {
    200: {
        "model": schemas.ChatCompletion,
        "description": "a chat.completion; with stream: true, Server-Sent Events each carrying a "
        "chat.completion.chunk (ChatCompletionChunk), ending with `data: [DONE]`",
        "content": {"text/event-stream": {"schema": {"$ref": "#/components/schemas/ChatEvent"}}},
    },
    **{s: {"model": schemas.ErrorResponse} for s in (400, 401, 404, 409, 413, 429, 500, 503, 504)},
}
COMPLETION_RESPONSES = {
    **CHAT_RESPONSES,
    200: {
        "model": schemas.TextCompletion,
        "description": "a text_completion; with stream: true, Server-Sent Events each carrying a "
        "text_completion with the text delta, ending with `data: [DONE]`",
        "content": {
            "text/event-stream": {"schema": {"$ref": "#/components/schemas/CompletionEvent"}}
        },
    },
}


@dataclass
class HttpContext:
    """What the HTTP app serves from (all owned by the gateway's server)."""

    config: GatewayConfig
    front_door: FrontDoor
    registry: WorkerRegistry
    executor: Executor  # runs each request's FrontDoor.run
    keys: BearerKeys | None = None
    dashboard: DashboardSampler | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))
    stopping: Event = field(default_factory=Event)
    # the gRPC port's readiness (``--ready-delay-s``, drain), which /health follows once set
    readiness: Readiness | None = None

    def served_models(self) -> list[str]:
        """``--served-model-name``, else the names the healthy language workers report."""
        if self.config.served_model_name:
            return [self.config.served_model_name]
        names = {w.info.get("model", "") for w in self.registry.healthy(Role.LANGUAGE)}
        return sorted(n for n in names if n)

    def count(self, outcome: str) -> None:
        self.front_door.metrics.finished(outcome, Api.HTTP.value)


def _json(obj: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(dumps(obj), status, headers, media_type="application/json")


def _error(error: HttpError) -> Response:
    return Response(error.encoded(), error.status, error.headers(), "application/json")


MIN_TIMEOUT_S = 1e-3  # a deadline shorter than a millisecond cannot be met: the client's mistake


def _timeout_s(value: float | None) -> float | None:
    """``X-Request-Timeout`` in seconds: finite and at least ``MIN_TIMEOUT_S`` (else a 400, not
    a 504 for a deadline that was over before the request was read)."""
    if value is not None and not (math.isfinite(value) and value >= MIN_TIMEOUT_S):
        raise invalid(
            f"X-Request-Timeout must be a finite number of seconds, at least {MIN_TIMEOUT_S:g}, "
            f"got {value}",
            "X-Request-Timeout",
        )
    return value


def create_app(ctx: HttpContext) -> ASGIApp:
    config = ctx.config
    app = FastAPI(
        title="epd-serve",
        summary="OpenAI-compatible chat completions over disaggregated encode/prefill serving",
        version="1",
        docs_url=None,
        redoc_url=None,
    )
    app.router.route_class = JsonBodyRoute  # before any route is added
    _add_error_handlers(app, ctx)

    @app.post(CHAT_PATH, response_model=None, responses=CHAT_RESPONSES)
    async def chat_completions(
        body: schemas.ChatCompletionRequest,
        request: Request,
        x_request_id: RequestIdHeader = None,
        x_request_timeout: TimeoutHeader = None,
    ) -> Response:
        """Create a chat completion (OpenAI's API), streamed with ``stream: true``."""
        with _counted(ctx):
            model = check_model(body.model, ctx.served_models())
            timeout_s = _timeout_s(x_request_timeout)
            proto, names = to_generate_request(body, x_request_id or "", ctx.front_door.limits)

        def writer(head: Head, include_usage: bool, request_ids: list[str]) -> AnswerWriter:
            n, logprobs = body.n or 1, bool(body.logprobs)
            if n == 1:
                return ChunkWriter(head, include_usage, logprobs)
            writers = [ChunkWriter(head, include_usage, logprobs, i) for i in range(n)]
            return ChoicesWriter(writers, request_ids, n, include_usage)

        return _answer(ctx, request, body, [proto], names, model, timeout_s, "chatcmpl", writer)

    @app.post(COMPLETIONS_PATH, response_model=None, responses=COMPLETION_RESPONSES)
    async def completions(
        body: schemas.CompletionRequest,
        request: Request,
        x_request_id: RequestIdHeader = None,
        x_request_timeout: TimeoutHeader = None,
    ) -> Response:
        """Create a completion of a raw prompt (OpenAI's legacy API), streamed with
        ``stream: true``."""
        with _counted(ctx):
            model = check_model(body.model, ctx.served_models())
            timeout_s = _timeout_s(x_request_timeout)
            limits = ctx.front_door.limits
            protos, names, ask = to_completion_requests(body, x_request_id or "", limits)

        def writer(head: Head, include_usage: bool, request_ids: list[str]) -> AnswerWriter:
            n = body.n or 1
            if len(request_ids) == 1 and n == 1:
                return CompletionWriter(head, include_usage, ask)
            num_choices = len(request_ids) * n
            writers = [CompletionWriter(head, include_usage, ask, i) for i in range(num_choices)]
            return ChoicesWriter(writers, request_ids, n, include_usage)

        rewrite = prompt_only if ask.prompt_only else None
        return _answer(ctx, request, body, protos, names, model, timeout_s, "cmpl", writer, rewrite)

    @app.get("/v1/models", response_model=schemas.ModelList, responses=ERRORS)
    async def list_models() -> Response:
        """The served model (one per deployment)."""
        data = [_model(name, ctx.started_at) for name in ctx.served_models()]
        return _json({"object": "list", "data": data})

    # NOTE: ``:path`` so that a name with slashes ("Qwen/Qwen2.5-VL-7B-Instruct") is one name
    @app.get("/v1/models/{model:path}", response_model=schemas.Model, responses=ERRORS)
    async def get_model(model: str) -> Response:
        """One served model; 404 ``model_not_found`` for any other name."""
        served = ctx.served_models()
        if model not in served:
            raise model_not_found(model, served)
        return _json(_model(model, ctx.started_at))

    @app.get("/health", response_model=schemas.Health, responses={503: {"model": schemas.Health}})
    async def health() -> Response:
        """200 while the gateway serves (with or without workers), 503 before it is ready
        (``--ready-delay-s``) and once it drains or stops."""
        workers = ctx.registry.all()
        pools = {
            role: {
                "healthy": sum(w.healthy for w in workers if w.role.value == role),
                "total": sum(w.role.value == role for w in workers),
            }
            for role in ROLES
        }
        status = "ok"
        if ctx.stopping.is_set() or (ctx.readiness is not None and ctx.readiness.draining):
            status = "stopping"
        elif ctx.readiness is not None and not ctx.readiness.ready:
            status = "starting"  # within --ready-delay-s: workers register first
        body = {"status": status, "workers": pools}
        return _json(body, 200 if status == "ok" else 503)

    if ctx.dashboard is not None:
        _add_dashboard(app, ctx, ctx.dashboard)
    _finish_openapi(app)
    return Guard(app, ctx.keys, config.max_message_mb << 20, lambda p, o: _refused(ctx, p, o))


@contextmanager
def _counted(ctx: HttpContext) -> Iterator[None]:
    """Count a request refused with an ``HttpError`` in the body under its outcome."""
    try:
        yield
    except HttpError as exc:
        ctx.count(outcome_of(exc.status))
        raise


def _answer(
    ctx: HttpContext,
    request: Request,
    body: schemas.SamplingFields,
    protos: list[gateway_pb2.GenerateRequest],
    names: FieldNames,
    model: str,
    timeout_s: float | None,
    id_prefix: str,
    make_writer: Callable[[Head, bool, list[str]], AnswerWriter],
    rewrite: Callable[[Iterator], Iterator] | None = None,
) -> Response:
    """Admit ``protos`` (one request each; a refusal of one cancels those admitted before it)
    and answer them (JSON, or events with ``stream``) in ``make_writer``'s shapes; the answer's
    id is ``<id_prefix>-<the request id>`` (of several: their id without its ``-i``)."""
    peer = f"{request.client.host}:{request.client.port}" if request.client else "-"
    caller = identity(request.headers.get("authorization"), peer)
    pumps: list[ChunkPump] = []
    request_ids: list[str] = []
    for proto in protos:
        try:
            admitted = ctx.front_door.admit(proto, caller, Api.HTTP)
        except GatewayError as exc:
            for pump in pumps:
                pump.close()
            raise from_gateway(exc, names) from None
        chunks = ctx.front_door.run(proto, admitted, timeout_s, Api.HTTP)
        if rewrite is not None:
            chunks = rewrite(chunks)
        pumps.append(ChunkPump(chunks, admitted.cancel, ctx.executor))
        request_ids.append(admitted.request_id)
    answer_id = request_ids[0] if len(protos) == 1 else protos[0].request_id.rsplit("-", 1)[0]
    head = Head(f"{id_prefix}-{answer_id}", int(time.time()), model)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    headers = {"x-request-id": answer_id}
    writer = make_writer(head, include_usage, request_ids)
    pump = pumps[0] if len(pumps) == 1 else MergedPump(pumps)
    return AnswerResponse(pump, writer, names, bool(body.stream), headers)


def _refused(ctx: HttpContext, path: str, outcome: str) -> None:
    if path in COUNTED_PATHS:
        ctx.count(outcome)


def _is_chat(request: Request) -> bool:
    """A completion request (counted in the gateway's series however it ends)."""
    return request.url.path in COUNTED_PATHS and request.method == "POST"


def _model(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": OWNER}


def _add_error_handlers(app: FastAPI, ctx: HttpContext) -> None:
    @app.exception_handler(HttpError)
    async def http_error(request: Request, exc: HttpError) -> Response:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> Response:
        error = _validation_error(exc, request.url.path)
        if _is_chat(request):
            ctx.count(outcome_of(error.status))
        return _error(error)

    @app.exception_handler(HTTPException)
    async def starlette_error(request: Request, exc: HTTPException) -> Response:
        error = status_error(exc.status_code, str(exc.detail))
        if _is_chat(request):
            ctx.count(outcome_of(error.status))
        headers = {**(exc.headers or {}), **error.headers()}
        return Response(error.encoded(), error.status, headers, "application/json")


def _validation_error(exc: RequestValidationError, url_path: str) -> HttpError:
    """A 400 for the first problem pydantic found, naming its JSON path."""
    first = exc.errors()[0]
    where, *path = first.get("loc", ("body",))
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return invalid(f"request body is not valid JSON: {detail}".rstrip(": "), None)
    if where == "body" and not path:
        needs = "prompt" if url_path == COMPLETIONS_PATH else "messages"
        return invalid(f"request body must be a JSON object with {needs}", None)
    if where == "header":
        param = "-".join(p.capitalize() for p in str(path[0]).split("-"))
    else:
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return invalid(f"{param}: {first.get('msg', 'invalid value')}", param or None)


def _finish_openapi(app: FastAPI) -> None:
    """What FastAPI cannot say by itself: bad requests are 400 here (OpenAI's status), never
    422; a streamed answer's events are ``ChatEvent``s (data: a chunk, an error, or [DONE])."""
    original = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = original()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            chunk = schemas.ChatCompletionChunk.model_json_schema(
                ref_template="#/components/schemas/{model}"
            )
            components.update(chunk.pop("$defs", {}))
            components["ChatCompletionChunk"] = chunk
            components["ChatEvent"] = schemas.CHAT_EVENT
            components["CompletionEvent"] = schemas.COMPLETION_EVENT
        return app.openapi_schema

    app.openapi = openapi


def _add_dashboard(app: FastAPI, ctx: HttpContext, sampler: DashboardSampler) -> None:
    files = resources.files("services.gateway.http") / "static"
    page = (files / "dashboard.html").read_bytes()
    assets = {name: (files / name).read_bytes() for name in STATIC}

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return Response(page, 200, PAGE_HEADERS, "text/html; charset=utf-8")

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_asset(name: str) -> Response:
        if name not in assets:
            raise HttpError(404, f"no such file: {name}", "not_found_error", None, "not_found")
        return Response(assets[name], 200, PAGE_HEADERS, STATIC[name])

    @app.get("/dashboard/state", include_in_schema=False)
    async def dashboard_state(request: Request) -> Response:
        authorization = request.headers.get("authorization")
        if ctx.keys is not None:
            show = key_problem(ctx.keys, authorization) is None
        else:
            show = ctx.config.dashboard_show_addresses
        return _json(sampler.state(show), headers={"cache-control": "no-store"})
