"""The wire format: request and response models (every response body is serialised through them), the
OpenAI error shape, and how bad input becomes an error.

Bounds on values the Engine checks (temperature >= 0, top_p in (0, 1], gamma >= 1, stop strings not
empty, ...) are not repeated here: the Engine's InvalidField becomes a 400 with its own message, its field
named as the request names it (engine_error). What stays here is the protocol itself: types, OpenAI's own limits
(temperature <= 2, 4 stop strings, n = 1), what this server allows a request to ask for (max_tokens, gamma and tree
caps), and the OpenAI fields it does not implement.
"""

# No `from __future__ import annotations`: request_models builds classes at run time, and pydantic must
# resolve their annotations where they are created.
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine import METHODS
from ..errors import InvalidField, InvalidJSON, MissingField, SpecDecodeError, UnsupportedParameter
from ..methods import help_text

MAX_GAMMA = 32  # draft tokens per target pass a request may ask for (a server's limit; the Engine has none)
# the tree shape a request may ask for (likewise): what can pay. A pass costs more the more tokens it holds, and the
# planner's own trees stay within 4 wide, 8 deep and 32 nodes (planning/planner.py); the Engine refuses a tree
# bigger than the backend's cache holds (llama.cpp: 255 nodes) by its own check
MAX_TREE_WIDTH, MAX_TREE_DEPTH, MAX_TREE_NODES = 16, 16, 128
STOP_MAX = 4  # stop strings per request, as in OpenAI's API
ENGINES = ("llama.cpp", "torch")  # the backends a request may pin (speculation.engine); a server holds one or both


def _omit_none(value) -> bool:
    return value is None


OMIT = dict(default=None, exclude_if=_omit_none)  # an optional field that is left out of the JSON when unset


# -- requests ---------------------------------------------------------------------------------------------------------
class Speculation(BaseModel):
    """specdecode extension: how to speculate for this request (defaults: the server's). Whatever is chosen, sampled
    output has exactly the target's distribution and greedy output is plain decoding's except at near-ties of the
    target's top two logits; with `exact`, bit for bit."""

    model_config = ConfigDict(strict=True, extra="forbid")
    method: Literal[METHODS] | None = Field(None, description=help_text())
    gamma: int | None = Field(None, le=MAX_GAMMA, description="draft tokens per target forward pass (chains)")
    tree_width: int | None = Field(None, le=MAX_TREE_WIDTH, description="tree: children per node (default: cost model)")
    tree_depth: int | None = Field(None, le=MAX_TREE_DEPTH, description="tree: depth (default: cost model)")
    tree_nodes: int | None = Field(None, le=MAX_TREE_NODES, description="tree: nodes per pass (default: cost model)")
    exact: bool | None = Field(
        None,
        description="exact greedy mode: output bit-for-bit plain decoding's (default: "
        "the server's --exact); needs a server started with --exact and temperature 0",
    )
    engine: Literal[ENGINES] | None = Field(
        None,
        description="the engine that runs the request (default: with "
        "--route, the one predicted to end first; responses name it in "
        "speculation.engine and system_fingerprint). Two engines round "
        "differently, so greedy text can differ between them at near-ties; "
        "one the server does not hold is a 400",
    )


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool | None = Field(None, description="send a last chunk with `usage` and no choices")
    include_sources: bool | None = Field(
        None,
        description="specdecode extension: each chunk's choice carries "
        "`sources`, one entry per token of its text (where it came from)",
    )


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (an edited file). A source of guesses that
    the target verifies like any other: the output stays the target's, only faster where the guess holds."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_engine_message(self) -> dict:
        """The Engine's form: developer messages are system messages, text parts are joined by newlines."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


def request_models(max_tokens_cap: int):
    """(CompletionRequest, ChatCompletionRequest) whose max_tokens bound is this app's (the model's context,
    or less). Fields that OpenAI defines and this server does not implement are kept (extra="allow") so that
    unsupported() can refuse them; other unknown fields are ignored."""
    MaxTokens = Annotated[
        int | None,
        Field(
            None,
            ge=1,
            le=max_tokens_cap,
            description=f"tokens to generate, at most {max_tokens_cap}; prompt + max_tokens must fit in the context",
        ),
    ]

    class _Common(BaseModel):
        model_config = ConfigDict(strict=True, extra="allow")
        model: str = Field(description="the served model id (GET /v1/models)")
        max_tokens: MaxTokens = None
        temperature: float | None = Field(
            None, le=2, description="0 = greedy (the default, unlike OpenAI's 1); at most 2, as in OpenAI's API"
        )
        top_p: float | None = Field(None, description="nucleus mass in (0, 1], default 1")
        top_k: int | None = Field(None, description="extension: 0 = off (default)")
        seed: int | None = Field(None, description="seed for sampling (any integer; used modulo 2**64)")
        stop: str | Annotated[list[str], Field(max_length=STOP_MAX)] | None = Field(
            None, description=f"up to {STOP_MAX} stop strings; the text ends before the first one"
        )
        n: int | None = Field(None, ge=1, le=1, description="number of choices: only 1 is supported")
        stream: bool | None = Field(False, description="stream server-sent events, ending with `data: [DONE]`")
        stream_options: StreamOptions | None = None
        speculation: Speculation | None = None
        prediction: Prediction | None = Field(
            None,
            description='Predicted Outputs: {"type": "content", '
            '"content": text or text parts} the answer is expected to repeat',
        )

    class CompletionRequest(_Common):
        prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] = Field(
            description="the prompt: a string (or a list holding one string)"
        )

    class ChatCompletionRequest(_Common):
        messages: list[ChatMessage]
        max_completion_tokens: MaxTokens = None

    return CompletionRequest, ChatCompletionRequest


# OpenAI request fields this server does not implement, each with the values that ask for nothing (accepted).
UNSUPPORTED = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
}


def _same(a, b) -> bool:
    """JSON equality: 0 == 0.0, but False is not 0."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def unsupported(body: BaseModel) -> UnsupportedParameter | None:
    """A 400 for the first OpenAI field in the request that asks for something this server does not do."""
    for name, value in (body.model_extra or {}).items():
        harmless = UNSUPPORTED.get(name)
        if harmless is not None and not any(_same(value, ok) for ok in harmless):
            allowed = " or ".join(json.dumps(ok) for ok in harmless)
            return UnsupportedParameter(
                f"{name} is not supported by this server (send {allowed}, or leave it out)", param=name
            )
    return None


# -- responses --------------------------------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class CompletionTokensDetails(BaseModel):
    """OpenAI's breakdown (specdecode.prediction says how they are counted). accepted_prediction_tokens: tokens of
    the prediction that appear in the completion, along the alignment of the two that keeps the most of it (their
    longest common subsequence); rejected_prediction_tokens: tokens of the prediction that do not appear in it (the
    whole prediction where the answer ended on its own; where max_tokens cut it, as far as it could have reached).
    OpenAI bills rejected tokens as output; here completion_tokens counts the answer's tokens alone."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    reasoning_tokens: int = 0
    audio_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, speculation: dict | None = None) -> "Usage":
        """speculation: the generation's Stats.as_dict(), which holds the prediction's counts (0 without one)."""
        spec = speculation or {}
        details = CompletionTokensDetails(
            accepted_prediction_tokens=spec.get("accepted_prediction_tokens", 0),
            rejected_prediction_tokens=spec.get("rejected_prediction_tokens", 0),
        )
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            completion_tokens_details=details,
        )


FinishReason = Literal["stop", "length"]
FINGERPRINT_DOC = (
    "the engine that ran the request (llama.cpp or torch): with --route two engines whose greedy text "
    "can differ at near-ties; a request can pin one (speculation.engine)"
)
SPECULATION_DOC = (
    "specdecode extension: the generation's statistics (Stats.as_dict(): method, gamma, drafted, "
    "accepted, acceptance_rate, accepted_per_position, mean_accepted_tokens, timings, finish_reason)"
)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = Field(None, description=FINGERPRINT_DOC)
    choices: list[CompletionChoice]
    usage: Usage
    speculation: dict[str, Any] = Field(description=SPECULATION_DOC)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = Field(None, description=FINGERPRINT_DOC)
    choices: list[ChatChoice]
    usage: Usage
    speculation: dict[str, Any] = Field(description=SPECULATION_DOC)


class TokenSource(BaseModel):
    """specdecode extension (stream_options.include_sources): one token of a chunk's text and where it came from.
    The entries' texts add up to the chunk's text; a token whose text two chunks share has an entry in each (the
    same `token`), and one with no text of its own (the end of text, a character's first bytes) an empty one."""

    token: int = Field(description="the token's place in the answer, from 0")
    text: str = Field(description="its part of this chunk's text")
    source: str = Field(
        description="target (the target's own token at its step), draft (the draft model), "
        "prediction, context (a copy of the prompt or the answer so far), history, datastore, lookup "
        "(an earlier output, where the server does not say which)"
    )
    step: int = Field(description="the target pass that emitted it, from 1 (the prompt's read)")
    drafted: int = Field(description="guesses that pass verified beside its root token")
    accepted: int = Field(description="of them, accepted")


SOURCES_DOC = "specdecode extension, with stream_options.include_sources: where each token of the text came from"


class CompletionChunkChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None
    sources: list[TokenSource] | None = Field(**OMIT, description=SOURCES_DOC)


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion; the last one carries finish_reason, usage, speculation."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = Field(None, description=FINGERPRINT_DOC)
    choices: list[CompletionChunkChoice]
    usage: Usage | None = Field(**OMIT)
    speculation: dict[str, Any] | None = Field(**OMIT, description=SPECULATION_DOC)


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(**OMIT)
    content: str | None = Field(**OMIT)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason | None = None
    sources: list[TokenSource] | None = Field(**OMIT, description=SOURCES_DOC)


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion; the last one with choices carries finish_reason,
    usage and speculation (with stream_options.include_usage, one more follows: no choices, usage)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = Field(None, description=FINGERPRINT_DOC)
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(**OMIT)
    speculation: dict[str, Any] | None = Field(**OMIT, description=SPECULATION_DOC)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdecode"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str
    busy: bool
    queued: int


def sse(model: BaseModel) -> str:
    """One server-sent event carrying a response model."""
    return f"data: {model.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_KEEPALIVE = ": keep-alive\n\n"  # a comment line: clients ignore it, proxies see a live connection


# -- errors -----------------------------------------------------------------------------------------------------------
def error_body(e: SpecDecodeError) -> ErrorBody:
    """An error in OpenAI's shape, {"error": {"message", "type", "param", "code"}}: its class says type and code."""
    return ErrorBody(error=ErrorDetail(message=e.message, type=e.type, param=e.param, code=e.code))


# The request field each Engine argument comes from ("{prompt}": the prompt or the messages); others keep their name.
WIRE_FIELDS = {
    "prompt": "{prompt}",
    "max_new_tokens": "max_tokens",
    "method": "speculation.method",
    "gamma": "speculation.gamma",
    "tree_width": "speculation.tree_width",
    "tree_depth": "speculation.tree_depth",
    "tree_nodes": "speculation.tree_nodes",
    "exact": "speculation.exact",
    "engine": "speculation.engine",
}


def engine_error(e: SpecDecodeError, prompt_param: str = "prompt") -> SpecDecodeError:
    """The Engine's rejection of a request, its field (`param`, the Engine's name) named as the request names it."""
    if e.param is None:
        return e
    return e.about(WIRE_FIELDS.get(e.param, e.param).format(prompt=prompt_param))


def validation_error(errors: list[dict]) -> SpecDecodeError:
    """pydantic's errors for a request body as one 400: the first error per field, up to four."""
    if not errors:
        return SpecDecodeError("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return InvalidJSON(f"the request body is not valid JSON{': ' + str(detail) if detail else ''}")
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
    kind = MissingField if first.get("type") == "missing" else InvalidField
    return kind(text, param=next(iter(parts)) or None)


def _is_type_tag(x) -> bool:
    """pydantic puts union member names into error locations ('str', 'list[str]', ...)."""
    return isinstance(x, str) and (x in ("str", "int", "float", "bool", "none") or any(c in x for c in "[-"))
