"""The method table: what each decoding method needs and how its drafter is built, in one place.

The Engine (validation, building the drafter, filling in Stats), the CLI, the server, the router and the bench
read this table instead of naming methods. Adding a method is one `Method` entry in METHOD_TABLE plus its
drafter (a `Drafter`, see drafters/base.py) and the function that builds it (builders.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from . import builders
from .errors import InvalidField
from .params import SamplingParams

REQUIRED, OPTIONAL, NO = "required", "optional", "no"  # Method.needs_draft_model
BASELINE = "autoregressive"  # plain decoding: what every speedup is measured against
DEFAULT_METHOD = "auto"  # what the Engine, the CLI and the server run when no method is named
DEFAULT_GAMMA = 4  # draft tokens per target pass where a request names no gamma (the methods that use it)


@dataclass(frozen=True)
class DraftRequest:
    """What one generation asks of its drafter (already checked by Engine.check)."""

    gamma: int
    params: SamplingParams
    tree_width: int | None = None
    tree_depth: int | None = None
    tree_nodes: int | None = None
    max_new_tokens: int | None = None
    history: Any = None  # the drafters.History it drafts from (None: none)
    prompt_ids: tuple = ()  # the prompt's tokens: a copy of them is followed through the output (drafters/copy.py)
    prediction_ids: tuple | None = None  # the client's predicted output, tokenized (None: none was sent)


@dataclass(frozen=True)
class Method:
    """One decoding method.

    needs_draft_model: REQUIRED (an error without one), OPTIONAL (used when loaded), NO (never loaded for it).
    uses_cost_model: its drafter plans on the measured pass costs (planning/costs.py; measured on first use).
    uses_lookup_sources: it drafts from the lookup sources (drafters/lookup.py: context, history, datastore).
    prompt_lookup: it drafts from the prompt's own text only (its stats name the "context" source).
    uses_gamma: gamma sets how many tokens a step drafts (Stats.gamma); other methods ignore it.
    tree_options: it takes tree_width / tree_depth / tree_nodes.
    chain: it drafts one chain per step, so the chain formulas (alpha, the Leviathan et al. bound) apply.
    planned: its drafter reports expected tokens per pass and caps its own depth (drafter.max_depth).
    drafts: it speculates at all (False only for plain decoding).
    bench_default: its place in the bench's default run (None: only when asked for).
    certify_default: its place in the methods `specdecode certify` checks by default (None: only when asked for).
    routable: a router may run it on any of its engines (it needs no draft model); others run on the first.
    build: what constructs its drafter, called with the engine's parts (builders.Parts) and the DraftRequest
      (builders.py holds the built-in methods'); None: no drafter (plain decoding).
    shape: the method's entry in Stats.tree, from (drafter, request); None: none.
    """

    name: str
    summary: str
    needs_draft_model: str = NO
    uses_cost_model: bool = False
    uses_lookup_sources: bool = False
    prompt_lookup: bool = False
    uses_gamma: bool = False
    tree_options: bool = False
    chain: bool = False
    planned: bool = False
    drafts: bool = True
    bench_default: int | None = None
    certify_default: int | None = None
    routable: bool = False
    build: Callable[[builders.Parts, DraftRequest], Any] | None = None
    shape: Callable[[Any, DraftRequest], dict | None] | None = None

    def make_drafter(self, parts: builders.Parts, request: DraftRequest):
        """The drafter of one generation from the engine's parts (None: plain decoding)."""
        return None if self.build is None else self.build(parts, request)


def _auto_shape(drafter, request: DraftRequest) -> dict:
    return {"draft_model": drafter.model is not None}


def _tree_shape(drafter, request: DraftRequest) -> dict:
    return {
        "width": drafter.width,
        "depth": drafter.max_depth,
        "nodes": drafter.max_nodes,
        "chosen_by_cost_model": [
            k
            for k, v in (("width", request.tree_width), ("depth", request.tree_depth), ("nodes", request.tree_nodes))
            if v is None
        ],
    }


METHOD_TABLE: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "auto",
            "the cost model picks plain decoding, lookup, a draft chain or a tree each step (default)",
            needs_draft_model=OPTIONAL,
            uses_cost_model=True,
            uses_lookup_sources=True,
            planned=True,
            bench_default=1,
            certify_default=3,
            routable=True,
            build=builders.build_auto,
            shape=_auto_shape,
        ),
        Method(
            BASELINE,
            "plain decoding through the same loop, the baseline of every speedup",
            drafts=False,
            bench_default=0,
            routable=True,
        ),
        Method(
            "draft",
            "a draft model with the same tokenizer proposes a chain of gamma tokens",
            needs_draft_model=REQUIRED,
            uses_gamma=True,
            chain=True,
            bench_default=3,
            certify_default=0,
            build=builders.build_draft,
        ),
        Method(
            "lookup",
            "a tree of lookup guesses (prompt, earlier outputs, datastore) shaped by the cost model",
            uses_cost_model=True,
            uses_lookup_sources=True,
            planned=True,
            routable=True,
            build=builders.build_lookup,
        ),
        Method(
            "pld",
            "prompt lookup: continues an earlier occurrence of the last tokens (gamma deep)",
            prompt_lookup=True,
            uses_gamma=True,
            chain=True,
            bench_default=2,
            certify_default=1,
            routable=True,
            build=builders.build_pld,
        ),
        Method(
            "tree",
            "a token tree from the draft model and lookup guesses, shaped by the cost model",
            needs_draft_model=OPTIONAL,
            uses_cost_model=True,
            uses_lookup_sources=True,
            tree_options=True,
            planned=True,
            certify_default=2,
            build=builders.build_tree,
            shape=_tree_shape,
        ),
    )
}


def method_names() -> tuple[str, ...]:
    """Every method, in the table's order."""
    return tuple(METHOD_TABLE)


def get_method(name: str) -> Method:
    """The table's entry for `name`; InvalidField naming the choices when there is none."""
    try:
        return METHOD_TABLE[name]
    except (KeyError, TypeError):
        raise InvalidField(
            f"unknown method {name!r}; choose one of {', '.join(METHOD_TABLE)}", param="method"
        ) from None


def names_where(**needs) -> list[str]:
    """The methods whose fields equal the given values, in the table's order: names_where(chain=True)."""
    return [m.name for m in METHOD_TABLE.values() if all(getattr(m, k) == v for k, v in needs.items())]


def in_default_run(field: str) -> list[str]:
    """The methods a default run includes, in its order: in_default_run("bench_default")."""
    placed = [(getattr(m, field), m.name) for m in METHOD_TABLE.values() if getattr(m, field) is not None]
    return [name for _, name in sorted(placed)]


def wants_draft_model(names) -> bool:
    """Whether any of these methods uses a draft model (required or optional); names not in the table
    (the bench's peers) are left to their caller."""
    return any(METHOD_TABLE[n].needs_draft_model != NO for n in names if n in METHOD_TABLE)


def uses_cost_model(name: str) -> bool:
    return name in METHOD_TABLE and METHOD_TABLE[name].uses_cost_model


def help_text() -> str:
    """One line per method, for --help and the README."""
    return "; ".join(f"{m.name}: {m.summary}" for m in METHOD_TABLE.values())
