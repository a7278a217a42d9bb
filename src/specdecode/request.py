"""One generation request, typed: what the CLI, the server (from a request's body) and the bench build once and hand
to `Engine.open`, and its text tokenized once (`Encoded`), which every engine that opens it reads (a router's
choice, a batch slot's engine).

    >>> request = Request("def fib(n):", method="draft", gamma=4, max_new_tokens=64)
    >>> stream = engine.open(request)          # or engine.open(engine.encode_request(request))

Torch-free: front ends build a request before anything loads torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .methods import DEFAULT_GAMMA, DEFAULT_METHOD


@dataclass(frozen=True)
class Request:
    """What to generate and how (Engine.stream's arguments, whose docstring says what each does).

    prompt: the text, or chat messages ({"role", "content"} dicts; chat is then implied); chat: apply the
    tokenizer's chat template to a text prompt. method and its shape: gamma (chain methods), tree_width/depth/nodes
    (method "tree"). max_new_tokens: the budget. temperature/top_k/top_p/seed: sampling. stop: strings that end the
    output. prediction: the text the output is expected to be, mostly. cache_scope: whose text this is, for the
    prompt cache. exact: exact greedy mode (None: the engine's default). history: the drafters.History it drafts
    from and adds its output to (None: the engine's own). engine: a router's engine to run it on (None: its choice).
    """

    prompt: str | list[dict]
    method: str = DEFAULT_METHOD
    gamma: int = DEFAULT_GAMMA
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    chat: bool = False
    tree_width: int | None = None
    tree_depth: int | None = None
    tree_nodes: int | None = None
    exact: bool | None = None
    history: Any = field(default=None, compare=False)
    cache_scope: str = ""
    prediction: str | None = None
    engine: str | None = None

    @property
    def stops(self) -> list[str]:
        """The stop strings as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def checked_fields(self) -> dict:
        """The fields Engine.check judges without models, as its keyword arguments."""
        return dict(
            method=self.method,
            gamma=self.gamma,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            stop=self.stop,
            tree_width=self.tree_width,
            tree_depth=self.tree_depth,
            tree_nodes=self.tree_nodes,
        )


@dataclass(frozen=True)
class Encoded:
    """A request with its prompt and prediction tokenized, once (Engine.encode_request): engines that share the
    tokenizer open it without tokenizing again."""

    request: Request
    prompt_ids: tuple[int, ...]
    prediction_ids: tuple[int, ...] | None = None  # None: no prediction (or an empty one)
