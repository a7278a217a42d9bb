"""The HTTP app: FastAPI routes that turn requests into Engine streams for the worker, and the worker's
events into responses (service.py: what the routes do); plus `run`, which serves it with uvicorn (the command that
loads the models: cli/serve.py).
"""

# No `from __future__ import annotations`: the POST routes are annotated with per-app request models.
import hmac
import ipaddress
import logging
import math
from contextlib import asynccontextmanager
from html import escape
from pathlib import Path

import anyio
import jinja2
import uvicorn
from fastapi import APIRouter, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..checks import positive_int
from ..errors import (
    InvalidField,
    MethodNotAllowed,
    NotFound,
    RequestTooLarge,
    ServerFault,
    SpecDecodeError,
    Unauthorized,
    UnsupportedMediaType,
)
from ..methods import DEFAULT_GAMMA, DEFAULT_METHOD, METHOD_TABLE, REQUIRED
from . import GRACEFUL_SHUTDOWN_S, protocol as p
from .metrics import Metrics
from .scheduler import Worker
from .service import Service, error_response, json_response

log = logging.getLogger("specdecode.server")

STATIC = Path(__file__).parent / "static"  # the web page at GET /: HTML, CSS and JavaScript modules, no build step
MAX_BODY_BYTES = 8 << 20  # request bodies beyond this get a 413 before they are read
KEEPALIVE_S = 10.0  # seconds between ": keep-alive" comments while a streamed request is silent (queued, reading)


class Gate:
    """ASGI middleware: the body size limit and request counting, and with `check` the API key on the `protected`
    paths outside /v1 (/metrics and the API docs, where asked for). (The key on /v1 is checked by its routes,
    BearerKey: under a path prefix only routing knows which route a path is.)"""

    ROUTES = {
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/health",
        "/metrics",
        "/openapi.json",
        "/docs",
        "/",
    }

    def __init__(
        self,
        app,
        metrics: Metrics,
        max_body_bytes: int | None = None,
        check: "BearerKey | None" = None,
        protected: frozenset[str] = frozenset(),
    ):
        self.app, self.metrics, self.max_body = app, metrics, max_body_bytes
        self.check, self.protected = check, protected

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, root = scope.get("path", ""), scope.get("root_path", "")
        path = path[len(root) :] if root and path.startswith(root) else path  # the path routing matches
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.check is not None and path in self.protected:
                try:
                    await self.check(Request(scope))
                except Unauthorized as e:
                    return await error_response(e)(scope, receive, send_status)
            if self.max_body is not None and _content_length(scope) > self.max_body:  # before reading it
                await error_response(too_large(self.max_body))(scope, receive, send_status)
            else:
                await self.app(scope, receive if self.max_body is None else self._limited(receive), send_status)
        finally:
            route = (
                path
                if path in self.ROUTES
                else (
                    "/v1/models/{model}"
                    if path.startswith("/v1/models/")
                    else "/static"
                    if path.startswith("/static/")
                    else "other"
                )
            )
            self.metrics.requests.labels(route=route, status=str(status[0])).inc()

    def _limited(self, receive):
        """receive, counting the body's bytes: a body sent without Content-Length (chunked) that grows past
        the limit is a 413 as soon as it does, before more of it is read."""
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    # Starlette's own exception: FastAPI turns others raised while it reads a body into a 400
                    raise StarletteHTTPException(RequestTooLarge.status, too_large(self.max_body).message)
            return message

        return limited


class BearerKey(HTTPBearer):
    """The API key, a security dependency of the /v1 router: `Authorization: Bearer <key>`, compared in
    constant time; a 401 otherwise."""

    def __init__(self, api_key: str):
        super().__init__(auto_error=False, scheme_name="HTTPBearer")
        self.key = api_key.encode()

    async def __call__(self, request: Request):
        credentials = await super().__call__(request)
        # header values are decoded as latin-1: back to the bytes the client sent, as the key's UTF-8
        if credentials is None or not hmac.compare_digest(credentials.credentials.strip().encode("latin-1"), self.key):
            raise Unauthorized("invalid or missing API key: send the header 'Authorization: Bearer <key>'")
        return credentials


def _v1_route(check: BearerKey | None) -> type[APIRoute]:
    """A route class whose checks run before FastAPI reads the request body (which it does before any dependency):
    `check`, the API key (a request without it gets its 401 without its body being read or parsed), then a POST's
    Content-Type. FastAPI parses a body without one as JSON, and a browser posts a cross-site form without asking
    first (text/plain, no CORS preflight): only a body declared application/json reaches a route (415 otherwise)."""

    class V1Route(APIRoute):
        def get_route_handler(self):
            handle = super().get_route_handler()

            async def checked(request: Request) -> Response:
                if check is not None:
                    await check(request)
                media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
                if request.method == "POST" and media_type != "application/json":
                    raise UnsupportedMediaType(
                        f"send the request body as JSON with the header 'Content-Type: "
                        f"application/json' (got {media_type or 'none'!r})"
                    )
                return await handle(request)

            return checked

    return V1Route


def _content_length(scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


def too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(f"the request body is larger than this server's limit of {limit} bytes")


# -- routes: each gets the app's Service from request.app.state --------------------------------------------------------
ERRORS = {
    400: {"model": p.ErrorBody, "description": "invalid request"},
    401: {"model": p.ErrorBody, "description": "missing or wrong API key"},
    404: {"model": p.ErrorBody, "description": "unknown model"},
    413: {"model": p.ErrorBody, "description": "request body over the server's limit"},
    415: {"model": p.ErrorBody, "description": "a body not sent as Content-Type: application/json"},
    503: {"model": p.ErrorBody, "description": "queue full or timed out waiting; see Retry-After"},
}
SSE_DOC = {"text/event-stream": {"schema": {"type": "object"}}}  # filled in by _openapi


async def health(request: Request):
    s: Service = request.app.state.service
    return json_response(p.Health(model=s.model_id, busy=s.worker.busy, queued=s.worker.queued))


async def prometheus_metrics(request: Request):
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def list_models(request: Request):
    return json_response(p.ModelList(data=[request.app.state.service.card()]))


async def get_model(model: str, request: Request):
    s: Service = request.app.state.service
    s.check_model(model)
    return json_response(s.card())


def _add_routes(app: FastAPI, service: Service, check: BearerKey | None) -> None:
    if check is None:
        v1 = APIRouter(prefix="/v1", tags=["openai"], route_class=_v1_route(None))
    else:
        v1 = APIRouter(
            prefix="/v1",
            tags=["openai"],
            dependencies=[Security(check)],
            route_class=_v1_route(check),
            responses={401: ERRORS[401]},
        )
    CompletionRequest, ChatCompletionRequest = p.request_models(service.cap)

    async def completions(body: CompletionRequest, request: Request):  # typed per app: its max_tokens bound
        _check_text([body.prompt] if isinstance(body.prompt, str) else body.prompt, "prompt")
        return await service.completions(body, request)

    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_text([m.as_engine_message()["content"] for m in body.messages], "messages")
        try:
            return await service.chat(body, request)
        except jinja2.TemplateError as e:
            if isinstance(e, jinja2.TemplateSyntaxError):  # the template itself is broken: the server's fault
                raise
            # raise_exception in the model's chat template: it refuses these messages (their roles' order, say)
            raise InvalidField(f"the model's chat template refused the messages: {e}", param="messages") from None

    app.add_api_route("/health", health, methods=["GET"], response_model=p.Health, tags=["server"])
    app.add_api_route(
        "/metrics",
        prometheus_metrics,
        methods=["GET"],
        tags=["server"],
        response_class=Response,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"}
        },
    )
    v1.add_api_route("/models", list_models, methods=["GET"], response_model=p.ModelList)
    v1.add_api_route(
        "/models/{model:path}", get_model, methods=["GET"], response_model=p.ModelCard, responses={404: ERRORS[404]}
    )
    v1.add_api_route(
        "/completions",
        completions,
        methods=["POST"],
        response_model=p.CompletionResponse,
        responses={**ERRORS, 200: {"content": SSE_DOC, "description": "a completion, or events when stream"}},
    )
    v1.add_api_route(
        "/chat/completions",
        chat_completions,
        methods=["POST"],
        response_model=p.ChatCompletionResponse,
        responses={**ERRORS, 200: {"content": SSE_DOC, "description": "a chat completion, or events when stream"}},
    )
    app.include_router(v1)


async def page(request: Request):
    """The web page. Its URLs are relative to a <base> at the app's root, so that it works under a path prefix (a
    Mount, uvicorn's --root-path) whether or not the address ends in a slash. It holds no data, so it needs no
    key: the page asks for one when /v1 answers 401."""
    root = escape(request.scope.get("root_path", "").rstrip("/"), quote=True)
    html = (STATIC / "index.html").read_text(encoding="utf-8").replace('<base href="./">', f'<base href="{root}/">', 1)
    return HTMLResponse(html, headers={"Cache-Control": "no-cache"})


def _add_page(app: FastAPI) -> None:
    app.add_api_route("/", page, methods=["GET"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")


def _check_text(texts: list[str], param: str) -> None:
    """A 400 for a lone UTF-16 surrogate (JSON's "\\ud800"): it is no character, and no tokenizer takes it."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidField(
                f"the {param} holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x} at character "
                f"{e.start}), which is not text; send UTF-8 text or a surrogate pair",
                param=param,
            ) from None


async def _api_error(request, exc: SpecDecodeError):
    return error_response(exc)


async def _invalid(request, exc: RequestValidationError):
    return error_response(p.validation_error(exc.errors()))


# Starlette's own refusals (routing, static files, the Gate's 413), each the error of its status
_HTTP_ERRORS = {404: NotFound, 405: MethodNotAllowed, 413: RequestTooLarge}


async def _http_error(request, exc: StarletteHTTPException):
    # Starlette's status and headers (a 405's Allow) in OpenAI's shape; a status not listed (a static file's range)
    # keeps its number
    err = _HTTP_ERRORS.get(exc.status_code, SpecDecodeError)(str(exc.detail))
    return json_response(p.error_body(err), exc.status_code, getattr(exc, "headers", None))


async def _crash(request, exc: Exception):
    log.exception("unhandled error")
    return error_response(ServerFault("internal server error"))


def _check_app_args(engine, method, gamma, max_queue, max_body_bytes, timeout_s, keepalive_s, api_key) -> None:
    """create_app's arguments, checked before anything starts (a clear SpecDecodeError for each)."""
    from ..engine import Engine

    Engine.check(method=method, gamma=gamma)  # the default speculation: the Engine's checks, at start-up
    if METHOD_TABLE[method].needs_draft_model == REQUIRED and engine.draft_model is None:
        raise SpecDecodeError(f"method {method!r} needs a draft model (--draft); or use --method pld / autoregressive")
    if gamma > p.MAX_GAMMA:
        raise SpecDecodeError(f"gamma must be an integer in 1..{p.MAX_GAMMA} (this server's limit), got {gamma!r}")
    for name, value in (("max_queue", max_queue), ("max_body_bytes", max_body_bytes)):
        positive_int(name, value)
    for name, value in (("timeout", timeout_s), ("keepalive_s", keepalive_s)):
        if not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
            raise SpecDecodeError(f"{name} must be a positive number of seconds, got {value!r}")
    if api_key is not None and not api_key:
        raise SpecDecodeError("the API key must not be empty")


def create_app(
    engine,
    *,
    model_id: str,
    method: str = DEFAULT_METHOD,
    gamma: int = DEFAULT_GAMMA,
    api_key: str | None = None,
    protect_all: bool = False,
    max_queue: int = 16,
    timeout_s: float = 300,
    max_tokens_cap: int | None = None,
    keepalive_s: float = KEEPALIVE_S,
    max_body_bytes: int = MAX_BODY_BYTES,
    show_sources: bool = False,
    slots=None,
) -> FastAPI:
    """An OpenAI-compatible app around `engine`.

    model_id: the name clients must send as `model`. method/gamma: the default speculation (a request may override both
    with `speculation: {"method", "gamma"}`; the Engine checks them per request). api_key: required as `Authorization:
    Bearer <key>` on /v1/* when set; with protect_all on /metrics and the API docs (/docs, /redoc, /openapi.json) too
    (/health and the web page stay open). max_queue: requests that may wait while one generates (more get 503).
    timeout_s: the longest a request may take, waiting included. max_tokens_cap: the largest max_tokens accepted
    (default and upper bound: the model's context). keepalive_s: seconds between keep-alive comments on a silent stream
    (queued, or reading its prompt). max_body_bytes: larger request bodies get a 413. show_sources: responses carry
    per-source draft counts (`speculation.sources`; off: with an output history they tell a client about other outputs).
    An engine with a history keeps one per API key (Service._history). slots: a slots.Slots on `engine`: its generations
    run at once, one per slot, sharing their passes (requests are still opened, checked and tokenized on `engine`).
    """
    _check_app_args(engine, method, gamma, max_queue, max_body_bytes, timeout_s, keepalive_s, api_key)
    if protect_all and api_key is None:
        raise SpecDecodeError("protect_all needs an API key: it puts /metrics and the API docs behind it")
    check = None if api_key is None else BearerKey(api_key)
    context = engine.target.max_length if slots is None else slots.engines[0].target.max_length
    cap = context if max_tokens_cap is None else max(1, min(int(max_tokens_cap), context))
    metrics = Metrics(model_id, method, gamma)
    worker = Worker(engine, max_queue, metrics, slots)
    service = Service(
        engine,
        worker,
        model_id=model_id,
        method=method,
        gamma=gamma,
        max_tokens_cap=cap,
        timeout_s=timeout_s,
        keepalive_s=keepalive_s,
        show_sources=show_sources,
        context=context,
    )

    @asynccontextmanager
    async def lifespan(app):
        await anyio.to_thread.run_sync(service.warm_up)  # cost measurement at start-up, never in a request
        worker.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(worker.stop)

    app = FastAPI(
        title="specdecode",
        version=_version(),
        lifespan=lifespan,
        description="OpenAI-compatible completions with speculative decoding: sampled output has the "
        "target's distribution, greedy output plain decoding's except at near-ties of the top "
        "two logits (bit for bit with `speculation.exact`). Extension: `speculation` in "
        "requests (method, gamma, exact, engine) and responses (stats); `system_fingerprint` "
        "names the engine that ran the request.",
    )
    app.state.service, app.state.engine, app.state.worker, app.state.metrics = service, engine, worker, metrics
    app.state.model_id, app.state.engine_lock = model_id, worker.lock
    protected = (
        frozenset(
            path
            for path in ("/metrics", app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url)
            if path
        )
        if protect_all
        else frozenset()
    )
    app.add_middleware(Gate, metrics=metrics, max_body_bytes=max_body_bytes, check=check, protected=protected)
    app.add_exception_handler(SpecDecodeError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _crash)
    _add_routes(app, service, check)
    _add_page(app)
    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document, less the 422 responses it adds by default (validation errors are 400 here), plus
    the schema of each server-sent event."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        # Each server-sent event: `data:` holds a JSON chunk (or an error object), and the last one `[DONE]`.
        _, defs = models_json_schema(
            [
                (p.CompletionChunk, "serialization"),
                (p.ChatCompletionChunk, "serialization"),
                (p.ErrorBody, "serialization"),
            ],
            ref_template="#/components/schemas/{model}",
        )
        for name, definition in defs.get("$defs", {}).items():
            components.setdefault(name, definition)
        for path, chunk in (("/v1/completions", "CompletionChunk"), ("/v1/chat/completions", "ChatCompletionChunk")):
            op = schema.get("paths", {}).get(path, {}).get("post")
            if op is None:
                continue
            data = {
                "oneOf": [
                    {"const": "[DONE]"},
                    {
                        "contentMediaType": "application/json",
                        "contentSchema": {
                            "anyOf": [
                                {"$ref": f"#/components/schemas/{chunk}"},
                                {"$ref": "#/components/schemas/ErrorBody"},
                            ]
                        },
                        "not": {"const": "[DONE]"},
                    },
                ]
            }
            op["responses"]["200"]["content"]["text/event-stream"] = {
                "schema": {
                    "type": "object",
                    "required": ["data"],
                    "properties": {"data": data},
                    "description": "one server-sent event, when `stream` is true",
                }
            }
        app.openapi_schema = schema
    return app.openapi_schema


class Server(uvicorn.Server):
    """uvicorn, whose shutdown first closes the app's worker without waiting for it: the running generation
    ends at its next step (a stream with an error event, then [DONE]) and waiting or new requests get a 503,
    so that shutting down never waits for generations to run to their end."""

    async def shutdown(self, sockets=None):
        worker = getattr(getattr(self.config.app, "state", None), "worker", None)
        if worker is not None:
            worker.close()
        await super().shutdown(sockets)


def _version() -> str:
    from .. import __version__

    return __version__


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(app: FastAPI, host: str, port: int) -> None:
    """Serve `app` with uvicorn on host:port until interrupted."""
    try:
        Server(
            uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        ).run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal it shut down on, as uvicorn.run does not
        pass


def limit_context(engine, ctx_size: int) -> None:
    """`--ctx-size`: the most tokens of prompt and output a request may use, on the engine or on every engine of a
    router (each request runs whole on one of them). Set after the pass costs are measured, which time passes at
    long contexts."""
    from ..routing import Router

    engines = list(engine.engines.values()) if isinstance(engine, Router) else [engine]
    least = min(e.target.max_length for e in engines)
    if ctx_size > least:
        raise SpecDecodeError(f"--ctx-size {ctx_size} is more than the model's context ({least} tokens)")
    for e in engines:
        e.target.max_length = ctx_size  # prompt + output of every request, the Engine's limit


def model_name(target: str) -> str:
    """The model id a server answers to by default: a GGUF file's stem, a directory's name, else the name."""
    path = Path(target)
    return path.stem if path.suffix == ".gguf" else (path.name if path.exists() else target)
