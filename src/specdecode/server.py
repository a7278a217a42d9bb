"""OpenAI-compatible HTTP server: `specdecode serve`.

    specdecode serve --method draft --gamma 4            # http://127.0.0.1:8000/v1

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream false or true;
streams are server-sent events in OpenAI's chunk format ending with `data: [DONE]`), GET /health,
GET /metrics (Prometheus text).

The Engine is not thread-safe (one KV cache per model), so every generation runs on ONE worker
thread fed by a bounded first-come-first-served queue. A request handler validates its input
(cheap checks and tokenization happen before queueing, so bad input is answered at once with a 4xx),
queues a job, and reads the job's events (text deltas, then the end) from an asyncio queue that the
worker feeds with loop.call_soon_threadsafe. A full queue answers 503 with Retry-After; a client that
goes away cancels its job (waiting: removed from the queue; running: the TextStream is closed at the
next delta); a job that outlives the per-request timeout is ended (finish_reason "length", and
"timeout" in the speculation stats).
"""
# No `from __future__ import annotations`: the request models are built per app (their bounds depend on
# the model's context), and FastAPI/pydantic must be able to resolve their annotations at class creation.
import asyncio
import collections
import ipaddress
import json
import logging
import math
import secrets
import threading
import time
import uuid
import weakref
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import METHODS
from .errors import SpecDecodeError

log = logging.getLogger("specdecode.server")

MAX_GAMMA = 32  # draft tokens per target pass a request may ask for
MAX_TREE = 256  # tree width / nodes per pass a request may ask for
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
STOP_MAX = 4  # stop strings per request, as in OpenAI's API
TINY = 1e-30  # the smallest temperature / top_p handed to the engine (see prepare)

# -- one lock per Engine ----------------------------------------------------------------------------
_ENGINE_LOCKS: "weakref.WeakKeyDictionary[Any, threading.Lock]" = weakref.WeakKeyDictionary()
_ENGINE_LOCKS_GUARD = threading.Lock()


def engine_lock(engine) -> threading.Lock:
    """The lock held while `engine` generates. Apps built around the same Engine share it, and code
    that calls the engine directly while a server around it is running must hold it too."""
    with _ENGINE_LOCKS_GUARD:
        lock = _ENGINE_LOCKS.get(engine)
        if lock is None:
            lock = _ENGINE_LOCKS[engine] = threading.Lock()
        return lock


# -- request and response models ---------------------------------------------------------------------
NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]


class Speculation(BaseModel):
    """specdecode extension: how to speculate for this request (defaults: the server's)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    method: Literal["auto", "autoregressive", "draft", "pld", "tree"] | None = Field(
        None, description="autoregressive (no speculation), draft (draft model), pld (prompt lookup) or "
                          "tree (a token tree from the draft model and prompt lookup, shaped by a cost model)")
    gamma: int | None = Field(None, ge=1, le=MAX_GAMMA, description="draft tokens per target forward pass (chains)")
    tree_width: int | None = Field(None, ge=1, le=MAX_TREE, description="tree: children per node (default: cost model)")
    tree_depth: int | None = Field(None, ge=1, le=MAX_GAMMA, description="tree: depth (default: cost model)")
    tree_nodes: int | None = Field(None, ge=1, le=MAX_TREE, description="tree: nodes per pass (default: cost model)")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool | None = Field(None, description="send a last chunk with `usage` and no choices")


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]
    name: str | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"]
SPECULATION_DOC = ("specdecode extension: the generation's statistics (Stats.as_dict(): method, gamma, drafted, "
                   "accepted, acceptance_rate, accepted_per_position, mean_accepted_tokens, timings, finish_reason)")


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speculation: dict[str, Any] = Field(description=SPECULATION_DOC)


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculation: dict[str, Any] = Field(description=SPECULATION_DOC)


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion; the last one carries finish_reason, usage, speculation."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
    speculation: dict[str, Any] | None = Field(None, description=SPECULATION_DOC)


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion; the last one with choices carries finish_reason,
    usage and speculation (with stream_options.include_usage, one more follows: no choices, usage)."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    speculation: dict[str, Any] | None = Field(None, description=SPECULATION_DOC)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]
    model: str
    busy: bool
    queued: int


def _request_models(max_tokens_cap: int):
    """Request bodies whose max_tokens bound is this app's (the model's context, or less)."""
    MaxTokens = Annotated[int | None, Field(None, ge=1, le=max_tokens_cap,
                                            description=f"tokens to generate, at most {max_tokens_cap}; "
                                                        "prompt + max_tokens must fit in the context")]

    class _Common(BaseModel):
        model_config = ConfigDict(strict=True)
        model: str = Field(description="the served model id (GET /v1/models)")
        max_tokens: MaxTokens = None
        temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False,
                                          description="0 = greedy (the default, unlike OpenAI's 1)")
        top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False, description="nucleus mass, default 1")
        top_k: int | None = Field(None, ge=0, le=1 << 20, description="extension: 0 = off (default)")
        seed: int | None = Field(None, description="seed for sampling (any integer; used modulo 2**64)")
        stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=STOP_MAX)] | None = Field(
            None, description=f"up to {STOP_MAX} stop strings; the text ends before the first one")
        n: int | None = Field(None, ge=1, le=1, description="number of choices: only 1 is supported")
        stream: bool | None = Field(False, description="stream server-sent events, ending with `data: [DONE]`")
        stream_options: StreamOptions | None = None
        speculation: Speculation | None = None

    class CompletionRequest(_Common):
        prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=1)] = Field(
            description="the prompt: a string (or a list holding one string)")

    class ChatCompletionRequest(_Common):
        messages: list[ChatMessage] = Field(min_length=1)
        max_completion_tokens: MaxTokens = None

    return CompletionRequest, ChatCompletionRequest


# -- errors --------------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON{': ' + str(detail) if detail else ''}",
                        code="invalid_json")
    parts: dict[str, str] = {}  # param -> message: the first error per place (unions report one per member)
    for err in errors:
        loc = list(err.get("loc", ()))
        if loc and loc[0] == "body":
            loc = loc[1:]
        path = ".".join(str(x) for x in loc if not _is_type_tag(x))
        if path in parts:
            continue
        if path:
            parts[path] = f"{path}: {err.get('msg', 'invalid value')}"
        elif err.get("type") == "missing":
            parts[path] = "the request body is missing: send a JSON object"
        else:
            parts[path] = "the request body must be a JSON object"
    messages = list(parts.values())
    text = "; ".join(messages[:4]) + (f"; and {len(messages) - 4} more" if len(messages) > 4 else "")
    code = "missing_field" if first.get("type") == "missing" else "invalid_value"
    return APIError(400, text, param=next(iter(parts)) or None, code=code)


def _is_type_tag(x) -> bool:
    """pydantic puts union member names into error locations ('str', 'list[constrained-str]', ...)."""
    return isinstance(x, str) and (x in ("str", "int", "float", "bool", "none") or any(c in x for c in "[-"))


# -- metrics --------------------------------------------------------------------------------------------
class Metrics:
    """Prometheus metrics in the app's own CollectorRegistry (several apps can live in one process)."""

    def __init__(self, model_id: str, method: str, gamma: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specdecode_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.generations = Counter("specdecode_generations", "generations by finish reason "
                                   "(stop, length, timeout, cancelled, error)", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("specdecode_prompt_tokens", "prompt tokens processed", registry=r)
        self.generated_tokens = Counter("specdecode_generated_tokens", "tokens generated", registry=r)
        self.drafted_tokens = Counter("specdecode_drafted_tokens", "draft tokens proposed", ["method"], registry=r)
        self.accepted_tokens = Counter("specdecode_accepted_tokens", "draft tokens accepted", ["method"],
                                       registry=r)
        self.drafted_by_position = Counter("specdecode_drafted_by_position", "draft tokens proposed at draft "
                                           "position i (0 = first)", ["position"], registry=r)
        self.accepted_by_position = Counter("specdecode_accepted_by_position", "draft tokens accepted at draft "
                                            "position i; acceptance at i = accepted / drafted", ["position"],
                                            registry=r)
        latency_buckets = (.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
        self.ttft = Histogram("specdecode_time_to_first_token_seconds", "from request arrival to the first text",
                              buckets=latency_buckets, registry=r)
        self.latency = Histogram("specdecode_request_latency_seconds", "from request arrival to the end of its "
                                 "generation", ["endpoint"], buckets=latency_buckets, registry=r)
        self.queue_wait = Histogram("specdecode_queue_wait_seconds", "time a request waited for the worker",
                                    buckets=latency_buckets, registry=r)
        self.queued = Gauge("specdecode_queue_depth", "requests waiting for the worker", registry=r)
        self.busy = Gauge("specdecode_worker_busy", "1 while the worker is generating", registry=r)
        info = Gauge("specdecode_server_info", "served model and default speculation",
                     ["model", "method", "gamma"], registry=r)
        info.labels(model=model_id, method=method, gamma=str(gamma)).set(1)

    def record(self, stats, endpoint: str, arrival: float, finish: str, ttft_seen: bool) -> None:
        now = time.monotonic()
        if not ttft_seen:
            self.ttft.observe(now - arrival)
        self.latency.labels(endpoint=endpoint).observe(now - arrival)
        self.generations.labels(finish_reason=finish).inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generated_tokens.inc(stats.new_tokens)
        self.drafted_tokens.labels(method=stats.method).inc(stats.drafted)
        self.accepted_tokens.labels(method=stats.method).inc(stats.accepted)
        for i, (d, a) in enumerate(zip(stats.drafted_per_position, stats.accepted_per_position)):
            self.drafted_by_position.labels(position=str(i)).inc(d)
            self.accepted_by_position.labels(position=str(i)).inc(a)


# -- the worker --------------------------------------------------------------------------------------------
class QueueFull(Exception):
    pass


class Job:
    """One generation request: what to generate, and the asyncio queue its events go to."""

    def __init__(self, loop: asyncio.AbstractEventLoop, endpoint: str, prompt, kwargs: dict, timeout_s: float):
        self.loop, self.endpoint, self.prompt, self.kwargs = loop, endpoint, prompt, kwargs
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()  # set when the client is gone (or the server shuts down)
        self.shutdown = False
        self.arrival = time.monotonic()
        self.deadline = self.arrival + timeout_s

    def push(self, event: tuple) -> None:
        """From the worker thread: hand an event to the request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled.set()


class Worker:
    """The one thread that runs the engine, fed by a bounded FIFO of jobs."""

    def __init__(self, engine, max_queue: int, metrics: Metrics):
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self.lock = engine_lock(engine)
        self._cv = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._current: Job | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._mean_s = 1.0  # moving average of job durations, for Retry-After
        metrics.queued.set_function(lambda: len(self._waiting))
        metrics.busy.set_function(lambda: self._current is not None)

    @property
    def queued(self) -> int:
        with self._cv:
            return len(self._waiting)

    @property
    def busy(self) -> bool:
        with self._cv:
            return self._current is not None

    @property
    def idle(self) -> bool:
        with self._cv:
            return self._current is None and not self._waiting

    def retry_after(self) -> int:
        with self._cv:
            ahead = len(self._waiting) + (self._current is not None)
        return max(1, min(600, math.ceil(self._mean_s * ahead)))

    def start(self) -> None:
        with self._cv:
            self._ensure_thread()

    def _ensure_thread(self) -> None:  # holds _cv
        if self._thread is None or not self._thread.is_alive():
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="specdecode-worker", daemon=True)
            self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull
            self._waiting.append(job)
            self._stopping = False  # a server that stopped and starts again (same app) serves again
            self._ensure_thread()
            self._cv.notify_all()

    def cancel(self, job: Job) -> None:
        """The client is gone: drop the job if it waits, stop it at its next delta if it runs."""
        job.cancelled.set()
        self.withdraw(job)

    def withdraw(self, job: Job) -> bool:
        """Take a job out of the queue if it is still waiting there (True), else leave it alone."""
        with self._cv:
            try:
                self._waiting.remove(job)
            except ValueError:
                return False
            job.cancelled.set()
            self._cv.notify_all()
            return True

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            if self._current is not None:
                self._current.shutdown = True
                self._current.cancelled.set()
            thread = self._thread
            self._cv.notify_all()
        for job in waiting:
            job.push(("error", APIError(503, "the server is shutting down", type="server_error",
                                        code="shutting_down")))
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def wait_idle(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        with self._cv:
            while self._current is not None or self._waiting:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                job = self._current = self._waiting.popleft()
            t0 = time.monotonic()
            try:
                self._run(job)
            except Exception:  # never let the worker die
                log.exception("generation failed")
                self.metrics.generations.labels(finish_reason="error").inc()
                job.push(("error", APIError(500, "internal error during generation", type="server_error",
                                            code="internal_error")))
            finally:
                self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - t0)
                with self._cv:
                    self._current = None
                    self._cv.notify_all()

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            return
        start = time.monotonic()
        self.metrics.queue_wait.observe(start - job.arrival)
        if start > job.deadline:
            self.metrics.generations.labels(finish_reason="timeout").inc()
            job.push(("error", APIError(503, "the request waited in the queue longer than the server's timeout",
                                        type="server_error", code="timeout", headers={"Retry-After": "1"})))
            return
        with self.lock:
            try:
                stream = self.engine.stream(job.prompt, **job.kwargs)
            except SpecDecodeError as e:
                self.metrics.generations.labels(finish_reason="error").inc()
                job.push(("error", APIError(400, " ".join(str(e).split()))))
                return
            parts: list[str] = []
            reason = None
            gen = iter(stream)
            try:
                for delta in gen:
                    if not parts:
                        self.metrics.ttft.observe(time.monotonic() - job.arrival)
                    parts.append(delta)
                    job.push(("delta", delta))
                    if job.cancelled.is_set():
                        reason = "cancelled"
                        break
                    if time.monotonic() > job.deadline:
                        reason = "timeout"
                        break
            except SpecDecodeError as e:  # raised before the first token (e.g. a prompt the context cannot hold)
                self.metrics.generations.labels(finish_reason="error").inc()
                job.push(("error", APIError(400, " ".join(str(e).split()))))
                return
            finally:
                gen.close()  # stops the generation loop and times it
        stats = stream.stats
        text = stream.result.text if stream.result is not None else "".join(parts)
        finish = reason or ("length" if stats.finish_reason == "length" else "stop")
        self.metrics.record(stats, job.endpoint, job.arrival, finish, ttft_seen=bool(parts))
        if reason == "cancelled":
            if job.shutdown:
                job.push(("error", APIError(503, "the server is shutting down", type="server_error",
                                            code="shutting_down")))
            return
        spec = stats.as_dict()
        if reason == "timeout":
            spec["finish_reason"] = "timeout"
        spec["queue_s"] = start - job.arrival
        job.push(("end", {"text": text, "finish_reason": "length" if finish in ("length", "timeout") else "stop",
                          "prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
                          "speculation": spec}))


# -- the app -------------------------------------------------------------------------------------------------
class _Gate:
    """ASGI middleware: the API key check on /v1/* (before the body is even parsed) and request counting."""

    ROUTES = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics", "/openapi.json",
              "/docs"}

    def __init__(self, app, api_key: str | None, metrics: Metrics):
        self.app, self.metrics = app, metrics
        self.key = None if api_key is None else f"bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.key is not None and (path == "/v1" or path.startswith("/v1/")) and not self._authorized(scope):
                err = APIError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await err.response()(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            route = path if path in self.ROUTES else ("/v1/models/{model}" if path.startswith("/v1/models/")
                                                      else "other")
            self.metrics.requests.labels(route=route, status=str(status[0])).inc()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return secrets.compare_digest(scheme.lower() + b" " + token.strip(), self.key)
        return False


class _Disconnected(Exception):
    pass


def create_app(engine, *, model_id: str, method: str = "draft", gamma: int = 4, api_key: str | None = None,
               max_queue: int = 16, timeout_s: float = 300, max_tokens_cap: int | None = None) -> FastAPI:
    """An OpenAI-compatible app around `engine`.

    model_id: the name clients must send as `model`. method/gamma: the default speculation (a request may
    override both with `speculation: {"method", "gamma"}`). api_key: required as `Authorization: Bearer <key>`
    on /v1/* when set. max_queue: requests that may wait while one generates (more get 503). timeout_s: the
    longest a request may take, waiting included. max_tokens_cap: the largest max_tokens accepted (default and
    upper bound: the model's context).
    """
    if method not in METHODS:
        raise SpecDecodeError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "draft" and engine.draft_model is None:
        raise SpecDecodeError("method 'draft' needs a draft model (pass --draft)")
    if isinstance(gamma, bool) or not isinstance(gamma, int) or not 1 <= gamma <= MAX_GAMMA:
        raise SpecDecodeError(f"gamma must be an integer in 1..{MAX_GAMMA}, got {gamma!r}")
    if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
        raise SpecDecodeError(f"max_queue must be a positive integer, got {max_queue!r}")
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0 or math.isinf(timeout_s):
        raise SpecDecodeError(f"timeout must be a positive number of seconds, got {timeout_s!r}")
    if api_key is not None and not api_key:
        raise SpecDecodeError("the API key must not be empty")
    context = engine.target.max_length
    cap = context if max_tokens_cap is None else max(1, min(int(max_tokens_cap), context))
    CompletionRequest, ChatCompletionRequest = _request_models(cap)

    metrics = Metrics(model_id, method, gamma)
    worker = Worker(engine, max_queue, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(worker.stop)

    app = FastAPI(title="specdecode", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible completions with lossless speculative decoding. "
                              "Extension: `speculation` in requests (method, gamma) and responses (stats).")
    app.state.engine, app.state.worker, app.state.metrics = engine, worker, metrics
    app.state.model_id, app.state.engine_lock = model_id, worker.lock
    app.add_middleware(_Gate, api_key=api_key, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):
        log.exception("unhandled error")
        return APIError(500, "internal server error", type="server_error", code="internal_error").response()

    bearer = [Depends(HTTPBearer(auto_error=False))] if api_key is not None else []  # documents the scheme
    errors = {400: {"model": ErrorBody, "description": "invalid request"},
              401: {"model": ErrorBody, "description": "missing or wrong API key"},
              404: {"model": ErrorBody, "description": "unknown model"},
              503: {"model": ErrorBody, "description": "queue full or timed out waiting; see Retry-After"}}
    sse = {"text/event-stream": {"schema": {"type": "object"}}}  # filled in by _openapi

    def card() -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "specdecode"}

    @app.get("/health", response_model=Health, tags=["server"])
    async def health():
        return {"status": "ok", "model": model_id, "busy": worker.busy, "queued": worker.queued}

    @app.get("/metrics", tags=["server"], response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, dependencies=bearer, tags=["openai"],
             responses={401: errors[401]})
    async def list_models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}", response_model=ModelCard, dependencies=bearer, tags=["openai"],
             responses={401: errors[401], 404: errors[404]})
    async def get_model(model: str):
        if model != model_id:
            raise _unknown_model(model, model_id)
        return card()

    @app.post("/v1/completions", response_model=CompletionResponse, dependencies=bearer, tags=["openai"],
              responses={**errors, 200: {"content": sse, "description": "a completion, or events when stream"}})
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        return await handle(request, body, "completions", prompt, chat=False)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, dependencies=bearer,
              tags=["openai"],
              responses={**errors, 200: {"content": sse, "description": "a chat completion, or events when stream"}})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)}
                    for m in body.messages]
        return await handle(request, body, "chat", messages, chat=True)

    async def handle(request: Request, body, endpoint: str, prompt, chat: bool):
        if body.model != model_id:
            raise _unknown_model(body.model, model_id)
        job = await prepare(body, endpoint, prompt, chat)
        try:
            worker.submit(job)
        except QueueFull:
            raise APIError(503, f"the server is busy ({max_queue} requests waiting); retry later",
                           type="server_error", code="queue_full",
                           headers={"Retry-After": str(worker.retry_after())}) from None
        done = False
        try:
            first = await next_event(job, request)
            if first[0] == "error":
                done = True
                return first[1].response()
            if body.stream:
                done = True  # the stream owns the job from here
                return _EventStream(stream_events(job, first, endpoint, body), worker, job)
            event = first
            while event[0] == "delta":  # the text comes whole with the end
                event = await next_event(job, request)
            done = True
            if event[0] == "error":
                return event[1].response()
            return JSONResponse(final_body(job, event[1], endpoint))
        except _Disconnected:
            return Response(status_code=499)
        finally:
            if not done:
                worker.cancel(job)

    async def prepare(body, endpoint: str, prompt, chat: bool) -> Job:
        spec = body.speculation or Speculation()
        req_method = spec.method or method
        req_gamma = spec.gamma or gamma
        tree = {k: getattr(spec, k) for k in ("tree_width", "tree_depth", "tree_nodes") if getattr(spec, k) is not None}
        if tree and req_method != "tree":
            raise APIError(400, "tree_width, tree_depth and tree_nodes apply to method 'tree' only",
                           param="speculation", code="invalid_value")
        if req_method == "draft" and engine.draft_model is None:
            raise APIError(400, "method 'draft' needs a draft model, and this server has none; "
                                "use 'pld' or 'autoregressive'", param="speculation.method", code="unsupported_value")
        param = "messages" if chat else "prompt"
        try:
            ids = await anyio.to_thread.run_sync(engine.encode, prompt, chat)
        except SpecDecodeError as e:
            raise APIError(400, " ".join(str(e).split()), param=param, code="invalid_value") from None
        room = context - len(ids)
        if room <= 0:
            raise APIError(400, f"the prompt has {len(ids)} tokens; the model's context holds {context}, "
                                "so no token can be generated", param=param, code="context_length_exceeded")
        if body.max_tokens is None:
            max_tokens = min(cap, room, COMPLETIONS_DEFAULT_MAX_TOKENS if endpoint == "completions" else room)
        elif body.max_tokens > room:
            raise APIError(400, f"the prompt has {len(ids)} tokens and max_tokens is {body.max_tokens}, but the "
                                f"model's context holds {context} tokens; ask for at most {room}",
                           param="max_tokens", code="context_length_exceeded")
        else:
            max_tokens = body.max_tokens
        seed = None if body.seed is None else body.seed % (1 << 64)
        temperature = float(body.temperature or 0.0)
        top_p = float(body.top_p if body.top_p is not None else 1.0)
        # Sampling runs in float32, where a positive value below ~1e-45 is 0 (0/0 = nan). Every temperature or
        # top_p below 1e-30 means the same as 1e-30 (the argmax; the top token), so lift them there.
        if temperature > 0:
            temperature = max(temperature, TINY)
        top_p = max(top_p, TINY)
        kwargs = dict(method=req_method, gamma=req_gamma, max_new_tokens=max_tokens, temperature=temperature,
                      top_k=body.top_k or 0, top_p=top_p, seed=seed, stop=body.stop, chat=chat, **tree)
        return Job(asyncio.get_running_loop(), endpoint, prompt, kwargs, timeout_s)

    async def next_event(job: Job, request: Request) -> tuple:
        """The job's next event; meanwhile notices a client that went away and a job stuck in the queue."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise _Disconnected from None
                if time.monotonic() > job.deadline and worker.withdraw(job):
                    worker.metrics.generations.labels(finish_reason="timeout").inc()
                    return ("error", APIError(503, "the request waited in the queue longer than the server's "
                                                   "timeout", type="server_error", code="timeout",
                                              headers={"Retry-After": str(worker.retry_after())}))

    def final_body(job: Job, end: dict, endpoint: str) -> dict:
        usage = {"prompt_tokens": end["prompt_tokens"], "completion_tokens": end["completion_tokens"],
                 "total_tokens": end["prompt_tokens"] + end["completion_tokens"]}
        if endpoint == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": end["text"]}, "logprobs": None,
                      "finish_reason": end["finish_reason"]}
            return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                    "model": model_id, "choices": [choice], "usage": usage, "speculation": end["speculation"]}
        choice = {"index": 0, "text": end["text"], "logprobs": None, "finish_reason": end["finish_reason"]}
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_id, "choices": [choice], "usage": usage, "speculation": end["speculation"]}

    async def stream_events(job: Job, first: tuple, endpoint: str, body):
        chat = endpoint == "chat"
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created_at = int(time.time())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(delta: str | None, finish: str | None = None, role: bool = False, **extra) -> str:
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
                obj = {"id": cid, "object": "chat.completion.chunk", "created": created_at, "model": model_id,
                       "choices": [choice], **extra}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
                obj = {"id": cid, "object": "text_completion", "created": created_at, "model": model_id,
                       "choices": [choice], **extra}
            return _sse(obj)

        try:
            if chat:
                yield chunk(None, role=True)
            event = first
            while True:
                if event[0] == "delta":
                    yield chunk(event[1])
                elif event[0] == "end":
                    end = event[1]
                    usage = {"prompt_tokens": end["prompt_tokens"], "completion_tokens": end["completion_tokens"],
                             "total_tokens": end["prompt_tokens"] + end["completion_tokens"]}
                    yield chunk(None, end["finish_reason"], usage=usage, speculation=end["speculation"])
                    if include_usage:
                        obj = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
                               "created": created_at, "model": model_id, "choices": [], "usage": usage}
                        yield _sse(obj)
                    break
                else:  # an error after the stream began
                    yield _sse(event[1].body())
                    break
                event = await job.events.get()
            yield "data: [DONE]\n\n"
        finally:
            worker.cancel(job)  # a no-op once the job has ended; stops it if the client went away

    app.openapi = lambda: _openapi(app)
    return app


class _EventStream(StreamingResponse):
    """Server-sent events; whatever ends the response (the end, a disconnect, an error) ends the job."""

    def __init__(self, content, worker: Worker, job: Job):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.worker, self.job = worker, job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.worker.cancel(self.job)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _unknown_model(asked: str, served: str) -> APIError:
    return APIError(404, f"the model {asked!r} does not exist; this server serves {served!r}", param="model",
                    code="model_not_found")


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document, less the 422 responses it adds by default (validation errors are 400 here)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        # Each server-sent event: `data:` holds a JSON chunk (or an error object), and the last one `[DONE]`.
        _, defs = models_json_schema([(CompletionChunk, "serialization"), (ChatCompletionChunk, "serialization"),
                                      (ErrorBody, "serialization")], ref_template="#/components/schemas/{model}")
        for name, definition in defs.get("$defs", {}).items():
            components.setdefault(name, definition)
        for path, chunk in (("/v1/completions", "CompletionChunk"), ("/v1/chat/completions", "ChatCompletionChunk")):
            op = schema.get("paths", {}).get(path, {}).get("post")
            if op is None:
                continue
            data = {"oneOf": [{"const": "[DONE]"},
                              {"contentMediaType": "application/json",
                               "contentSchema": {"anyOf": [{"$ref": f"#/components/schemas/{chunk}"},
                                                           {"$ref": "#/components/schemas/ErrorBody"}]},
                               "not": {"const": "[DONE]"}}]}
            op["responses"]["200"]["content"]["text/event-stream"] = {"schema": {
                "type": "object", "required": ["data"], "properties": {"data": data},
                "description": "one server-sent event, when `stream` is true"}}
        app.openapi_schema = schema
    return app.openapi_schema


def _version() -> str:
    from . import __version__
    return __version__


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(args) -> None:
    """`specdecode serve`: load the models, then run uvicorn until interrupted."""
    import os
    import sys

    import uvicorn

    from .engine import Engine
    from .models import DEFAULT_TARGET
    if not 0 <= args.port <= 65535:
        raise SpecDecodeError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 1:
        raise SpecDecodeError(f"--max-queue must be positive, got {args.max_queue}")
    if not args.timeout > 0 or math.isinf(args.timeout):
        raise SpecDecodeError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if not 1 <= args.gamma <= MAX_GAMMA:
        raise SpecDecodeError(f"--gamma must be in 1..{MAX_GAMMA}, got {args.gamma}")
    if args.method == "draft" and args.target is not None and args.draft is None:
        raise SpecDecodeError("method 'draft' needs a draft model (--draft); or use --method pld / autoregressive")
    api_key = args.api_key if args.api_key is not None else os.environ.get("SPECDECODE_API_KEY") or None
    if args.api_key is not None and not args.api_key:
        raise SpecDecodeError("--api-key must not be empty")
    model_id = args.served_model_name or _model_name(args.target or DEFAULT_TARGET)
    engine = Engine.load(args.target, args.draft, backend=args.backend, dtype=args.dtype, device=args.device,
                         threads=args.threads, with_draft=args.method in ("draft", "tree", "auto") or args.draft is not None,
                         draft_quant=args.draft_quant)
    if args.method in ("tree", "auto"):
        engine.tree_costs()  # measure pass costs now (once per machine), not in the first request
    app = create_app(engine, model_id=model_id, method=args.method, gamma=args.gamma, api_key=api_key,
                     max_queue=args.max_queue, timeout_s=args.timeout)
    if not _is_loopback(args.host) and api_key is None:
        sys.stderr.write(f"specdecode: warning: listening on {args.host} without an API key (--api-key)\n")
    sys.stderr.write(f"specdecode: serving {model_id!r} at http://{args.host}:{args.port}/v1 "
                     f"(method {args.method}, gamma {args.gamma}, backend {engine.backend})\n")
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


def _model_name(target: str) -> str:
    from pathlib import Path
    p = Path(target)
    return p.stem if p.suffix == ".gguf" else (p.name if p.exists() else target)
