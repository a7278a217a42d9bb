"""What the routes do: `Service.open` validates and tokenizes a request once, by opening an Engine stream
(the Engine's SpecDecodeError becomes a 400 with its message) and checking the prompt against the context;
the stream is queued as a Job (a full queue is a 503 with Retry-After); then the job's events become one
JSON body, or server-sent events whose headers go out at once (with ": keep-alive" comments while the job
is silent: queued, or reading its prompt).
"""

# No `from __future__ import annotations`, as in app.py: pydantic and FastAPI read the annotations.
import hashlib
import logging
import time
import uuid
from collections import OrderedDict

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from ..drafters import History
from ..errors import ContextExceeded, InvalidField, ModelNotFound, ServerFault, SpecDecodeError
from ..methods import uses_cost_model
from ..request import Request as EngineRequest
from . import protocol as p
from .scheduler import OPENING_AT_ONCE, Disconnected, Job, Worker

log = logging.getLogger("specdecode.server")

MAX_HISTORY_SCOPES = 16  # API keys whose output histories are kept, the least recently used dropped first
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left


def json_response(model: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(model.model_dump_json(), status_code=status, headers=headers, media_type="application/json")


def error_response(err: SpecDecodeError) -> Response:
    """The error as its class answers it: status, OpenAI's body, headers (Retry-After, WWW-Authenticate)."""
    return json_response(p.error_body(err), err.status, err.headers())


class EventStream(StreamingResponse):
    """Server-sent events; whatever ends the response (the end, a disconnect, an error) ends the job."""

    def __init__(self, content, worker: Worker, job: Job):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **engine_header(job)},
        )
        self.worker, self.job = worker, job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.worker.cancel(self.job)


class Service:
    """What the routes do: one served model, its default speculation, the worker."""

    def __init__(
        self,
        engine,
        worker: Worker,
        *,
        model_id: str,
        method: str,
        gamma: int,
        max_tokens_cap: int,
        timeout_s: float,
        keepalive_s: float,
        show_sources: bool = False,
        context: int | None = None,
    ):
        self.engine, self.worker, self.model_id = engine, worker, model_id
        self.method, self.gamma, self.cap = method, gamma, max_tokens_cap
        self.timeout_s, self.keepalive_s = timeout_s, keepalive_s
        # the tokens of prompt and output a request may use: where batch slots run them, what one slot holds
        self.context = engine.target.max_length if context is None else context
        self.created = int(time.time())
        self.token_chars = _longest_token(engine)  # no token covers more characters (None: unknown)
        self.normalized = _normalizes(engine)  # its normalizer may change the text's length: a looser pre-check
        separate = getattr(engine, "separate_encoder", None)
        if separate is not None:  # requests are encoded on a tokenizer of their own: the worker never waits for them
            separate(OPENING_AT_ONCE)  # a copy for each request tokenized at once: a big body holds up no other
        self.show_sources = show_sources  # per-source draft counts in responses (they tell of other outputs)
        self.histories: OrderedDict[str, History] = OrderedDict()  # per API key (its hash)
        held = getattr(engine, "engines", None)  # a Router's engines by name (--route); an Engine is one
        self.routed = isinstance(held, dict)
        self.engine_names = tuple(held) if self.routed else (engine.backend,)

    def card(self) -> p.ModelCard:
        return p.ModelCard(id=self.model_id, created=self.created)

    def check_model(self, model: str) -> None:
        if model != self.model_id:
            raise ModelNotFound(f"the model {model!r} does not exist; this server serves {self.model_id!r}")

    async def completions(self, body, request: Request) -> Response:
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        return await self.generate(body, request, "completions", prompt)

    async def chat(self, body, request: Request) -> Response:
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        return await self.generate(body, request, "chat", [m.as_engine_message() for m in body.messages])

    async def generate(self, body, request: Request, endpoint: str, prompt) -> Response:
        self.check_model(body.model)
        refused = p.unsupported(body)
        if refused is not None:
            raise refused
        self._admit()  # before the expensive work: tokenizing
        self._check_length(prompt, "messages" if endpoint == "chat" else "prompt")
        if body.prediction is not None:
            self._check_prediction(body.prediction.text())
        self._check_engine(body.speculation)
        job = Job(
            await self.open(body, endpoint, prompt, self._history(request), self._scope(request)),
            endpoint,
            self.timeout_s,
        )
        if body.stream and body.stream_options and body.stream_options.include_sources:
            job.sources = self._public_source
        self._admit(job)
        if body.stream:
            return EventStream(self.events(job, body, endpoint), self.worker, job)
        try:
            async for kind, value in self.worker.events(job, request.is_disconnected):
                if kind == "error":
                    return error_response(value)
                if kind == "end":
                    return json_response(self.final(value, endpoint), headers=engine_header(job))
        except Disconnected:
            return Response(status_code=499)
        finally:
            self.worker.cancel(job)  # a no-op once the job has ended
        raise AssertionError("the worker ended a job without an end or an error")

    def _admit(self, job: Job | None = None) -> None:
        """Queue the job, or (without one) check that the queue has room for one: a 503 when it has not."""
        if job is None:
            self.worker.check_room()
        else:
            self.worker.submit(job)

    def _check_length(self, prompt, param: str) -> None:
        """A prompt with more characters than the context's tokens could cover is refused before tokenizing."""
        chars = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
        factor = 2 if self.normalized else 1  # a normalizer may shorten the text (composing characters)
        most = None if self.token_chars is None else factor * self.token_chars * self.context
        if most is not None and chars > most:
            raise ContextExceeded(
                f"the prompt has {chars} characters, more than the {self.context} tokens of the "
                "model's context can hold, so no token can be generated",
                param=param,
            )

    def _check_prediction(self, text: str) -> None:
        """Before tokenizing: a prediction that is no text (a lone UTF-16 surrogate) or that has more characters than
        the context's tokens could cover is refused (open() checks its tokens against the context)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidField(
                f"the prediction holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x} at "
                f"character {e.start}), which is not text; send UTF-8 text or a surrogate pair",
                param="prediction",
            ) from None
        most = None if self.token_chars is None else (2 if self.normalized else 1) * self.token_chars * self.context
        if most is not None and len(text) > most:
            raise ContextExceeded(
                f"the prediction has {len(text)} characters, more than the {self.context} tokens "
                "of the model's context can hold",
                param="prediction",
            )

    def _check_engine(self, spec) -> None:
        """A pinned engine this server does not run is a 400 naming the field, before tokenizing."""
        if spec is not None and spec.engine is not None and spec.engine not in self.engine_names:
            raise InvalidField(
                f"speculation.engine is {spec.engine!r}, but this server runs "
                f"{' and '.join(map(repr, self.engine_names))}",
                param="speculation.engine",
            )

    def _history(self, request: Request) -> History | None:
        """The output history of the request's API key (the bearer token it sends, whether or not the server asks
        for one), where the engine keeps a history at all: one key's outputs are never drafted from for another's."""
        if getattr(self.engine, "history", None) is None:
            return None
        scope = self._scope(request)
        history = self.histories.pop(scope, None) or History(self.engine.history.max_tokens)
        self.histories[scope] = history
        while len(self.histories) > MAX_HISTORY_SCOPES:
            self.histories.popitem(last=False)
        return history

    @staticmethod
    def _scope(request: Request) -> str:
        """Whose request this is: a hash of the API key it sends (whether or not the server asks for one). Its output
        history and the prompt cache serve that key only: one client's text never speeds up another's."""
        return hashlib.sha256(request.headers.get("authorization", "").encode()).hexdigest()

    def _public_source(self, source: str) -> str:
        """A token's source as a client may see it: a copy of an earlier output is "lookup" unless the operator shows
        sources (it tells of other outputs, as `speculation.sources` does)."""
        return source if self.show_sources or source != "history" else "lookup"

    def _speculation(self, spec: dict) -> dict:
        return spec if self.show_sources else {k: v for k, v in spec.items() if k != "sources"}

    async def open(self, body, endpoint: str, prompt, history: History | None = None, scope: str = ""):
        """The request as an Engine stream, opened (validated, tokenized once) but not started."""
        request = self.engine_request(body, endpoint, prompt, history, scope)
        param = "messages" if request.chat else "prompt"
        try:  # batch slots: a tree a slot cannot hold is a 400, not a stream error
            self.worker.check_tree(
                method=request.method,
                tree_width=request.tree_width,
                tree_depth=request.tree_depth,
                tree_nodes=request.tree_nodes,
            )
            stream = await self.worker.open(self._open_stream, request)  # while it waits, it counts as queued
        except SpecDecodeError as e:
            raise p.engine_error(e, param) from None
        predicted = stream.prediction_ids
        if predicted is not None and len(predicted) > self.context:
            raise ContextExceeded(
                f"the prediction has {len(predicted)} tokens; the model's context holds {self.context}",
                param="prediction",
            )
        # the engine that runs it, named in the response: a Router's choice, or the one engine's backend
        stream.stats.engine = stream.stats.engine or self.engine_names[0]
        n = stream.stats.prompt_tokens
        room = self.context - n
        if room <= 0:
            raise ContextExceeded(
                f"the prompt has {n} tokens; the model's context holds {self.context}, so no token can be generated",
                param=param,
            )
        if body.max_tokens is not None and body.max_tokens > room:
            raise ContextExceeded(
                f"the prompt has {n} tokens and max_tokens is {body.max_tokens}, but the model's "
                f"context holds {self.context} tokens; ask for at most {room}",
                param="max_tokens",
            )
        return stream

    def engine_request(
        self, body, endpoint: str, prompt, history: History | None = None, scope: str = ""
    ) -> EngineRequest:
        """The body as the engine's typed request, with this server's defaults (method, gamma, max_tokens)."""
        spec = body.speculation or p.Speculation()
        if body.max_tokens is not None:
            max_tokens = body.max_tokens
        else:  # the Engine stops at the context, so "the room left" is the cap
            max_tokens = min(self.cap, COMPLETIONS_DEFAULT_MAX_TOKENS) if endpoint == "completions" else self.cap
        gamma = self.gamma if spec.gamma is None else spec.gamma
        return EngineRequest(
            prompt,
            method=spec.method or self.method,
            gamma=gamma,
            max_new_tokens=max_tokens,
            temperature=0.0 if body.temperature is None else body.temperature,
            top_k=body.top_k or 0,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=None if body.seed is None else body.seed % (1 << 64),
            stop=body.stop,
            chat=endpoint == "chat",
            tree_width=spec.tree_width,
            tree_depth=spec.tree_depth,
            tree_nodes=spec.tree_nodes,
            exact=spec.exact,
            history=history,
            cache_scope=scope,
            prediction=body.prediction.text() if body.prediction else None,
            engine=spec.engine if self.routed else None,
        )

    def warm_up(self) -> None:
        """At start-up, before any request: measure (once per machine; cached) or read what a request would
        otherwise measure on its first use: the pass costs any request's method may plan on, and exact mode's
        pass sizes where the target was loaded for exact mode."""
        self.engine.tree_costs()
        if getattr(self.engine.target, "exact", False):
            self.engine.exact_limits()

    def _open_stream(self, request: EngineRequest):
        # Opening a stream reads only the tokenizer, except that the methods that plan on the cost model measure
        # the pass costs on first use (once per machine): warm_up does that at start-up; an app run without its
        # lifespan measures them here, which runs the models, so it waits for the worker.
        if uses_cost_model(request.method) and getattr(self.engine, "costs", None) is None:
            with self.worker.lock:
                return self.engine.open(request)
        return self.engine.open(request)

    def final(self, end, endpoint: str) -> BaseModel:
        usage = p.Usage.of(end.prompt_tokens, end.completion_tokens, end.speculation)
        fingerprint = end.speculation.get("engine")
        if endpoint == "chat":
            return p.ChatCompletionResponse(
                id=f"chatcmpl-{uuid.uuid4().hex}",
                created=int(time.time()),
                model=self.model_id,
                usage=usage,
                system_fingerprint=fingerprint,
                choices=[p.ChatChoice(message=p.AssistantMessage(content=end.text), finish_reason=end.finish_reason)],
                speculation=self._speculation(end.speculation),
            )
        return p.CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.model_id,
            usage=usage,
            system_fingerprint=fingerprint,
            choices=[p.CompletionChoice(text=end.text, finish_reason=end.finish_reason)],
            speculation=self._speculation(end.speculation),
        )

    async def events(self, job: Job, body, endpoint: str):
        """The job as server-sent events: keep-alive comments while it is silent (queued, or reading its prompt), a
        chunk per delta, the last chunk
        with finish_reason, usage and speculation, then `data: [DONE]`."""
        chat = endpoint == "chat"
        head = dict(
            id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.model_id,
            system_fingerprint=job.stream.stats.engine,
        )
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(
            text: str | None = None, finish: str | None = None, sources: list | None = None, **extra
        ) -> BaseModel:
            if chat:
                delta = p.ChatDelta() if text is None else p.ChatDelta(content=text)
                return p.ChatCompletionChunk(
                    **head, **extra, choices=[p.ChatChunkChoice(delta=delta, finish_reason=finish, sources=sources)]
                )
            return p.CompletionChunk(
                **head,
                **extra,
                choices=[p.CompletionChunkChoice(text=text or "", finish_reason=finish, sources=sources)],
            )

        if chat:
            yield p.sse(
                p.ChatCompletionChunk(
                    **head, choices=[p.ChatChunkChoice(delta=p.ChatDelta(role="assistant", content=""))]
                )
            )
        try:
            async for kind, value in self.worker.events(job, keepalive_s=self.keepalive_s):
                if kind == "wait":
                    yield p.SSE_KEEPALIVE
                elif kind == "delta":  # (text, per-token entries) where the request asked for sources
                    yield p.sse(chunk(value) if isinstance(value, str) else chunk(value[0], sources=value[1]))
                elif kind == "end":
                    usage = p.Usage.of(value.prompt_tokens, value.completion_tokens, value.speculation)
                    yield p.sse(
                        chunk(None, value.finish_reason, usage=usage, speculation=self._speculation(value.speculation))
                    )
                    if include_usage:
                        last = p.ChatCompletionChunk if chat else p.CompletionChunk
                        yield p.sse(last(**head, choices=[], usage=usage))
                else:  # an error after the stream began
                    yield p.sse(p.error_body(value))
        except Exception:  # never a silently truncated stream: the last event says what happened
            log.exception("stream failed")
            yield p.sse(p.error_body(ServerFault("internal error during generation")))
        yield p.SSE_DONE


def engine_header(job: Job) -> dict[str, str]:
    """The response header naming the engine that runs the job (as system_fingerprint and speculation.engine do)."""
    name = job.stream.stats.engine
    return {"X-Specdecode-Engine": name} if name else {}


def _normalizes(engine) -> bool:
    """Whether the engine's tokenizer normalizes text before splitting it (unknown: True)."""
    backend = getattr(getattr(engine, "tokenizer", None), "backend_tokenizer", None)
    return backend is None or backend.normalizer is not None


def _longest_token(engine) -> int | None:
    """The most characters one token of the engine's tokenizer stands for (its longest vocabulary entry)."""
    try:
        return max(map(len, engine.tokenizer.get_vocab()))
    except (AttributeError, TypeError, ValueError):
        return None
