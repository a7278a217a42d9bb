"""The drafters of the built-in methods, each built by a function that the method table (methods.py) names.

A builder gets the engine's parts it may draft with (`Parts`: the target, the draft model, the measured pass costs,
the datastore) and what one generation asks of its drafter (`DraftRequest`: gamma, the tree's shape, the history,
the prompt's and the prediction's tokens), and returns a `Drafter` (None: plain decoding). Every generation plans
with a fresh TreeState: a tree's shape (so a near-tie's side) never depends on what the engine generated before.
The method table names these functions and is read before torch loads (the command line checks a request first):
what they build is imported when they run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .errors import InvalidField, SpecDecodeError

if TYPE_CHECKING:
    from .drafters import DraftModel, Lookup, PromptLookup
    from .planning.tree import TreeDrafter

AUTO_PROBE_STEPS = 4  # auto's first steps without the draft model: a measured baseline to compare it with
FIXED_TREE_NODES = 256  # nodes per pass of a tree whose size the cost model does not choose, at most


@dataclass(frozen=True)
class Parts:
    """What an engine lends the drafter of one generation."""

    target: Any  # the target LM (backends.LM)
    draft_model: DraftModel | None = None  # None: no draft model loaded
    costs: Callable[[], Any] | None = None  # the measured CostModel (planning/costs.py): measured on its first call
    datastore: Any = None  # a drafters.Datastore (None: none)


def tree_error(target, draft_model: DraftModel | None) -> str | None:
    """Why the target or this draft model cannot run token trees (None: both can)."""
    lms = (target, draft_model.lm if draft_model is not None else None)
    return next((e for e in (lm.tree_error() for lm in lms if lm is not None) if e), None)


def ids_held(target, draft_model: DraftModel | None) -> int | None:
    """Tree nodes the caches of the target and this draft model hold at once (None: no cap)."""
    caps = [
        lm.max_tree_nodes
        for lm in (target, draft_model.lm if draft_model is not None else None)
        if lm is not None and lm.max_tree_nodes is not None
    ]
    return min(caps, default=None)


def tree_nodes_cap(request, lms) -> int:
    """The most tree nodes one pass of this request may verify: what every model's cache holds (LM.max_tree_nodes)
    and at most FIXED_TREE_NODES (a tree of fixed width grows up to width**2 nodes per depth). SpecDecodeError
    naming the parameter when the request asks for a tree that a model's cache cannot hold."""
    from .planning.planner import MAX_DEPTH

    caps = [lm.max_tree_nodes for lm in lms if lm is not None and lm.max_tree_nodes is not None]
    cap = min(caps, default=None)
    if cap is not None and request.tree_nodes is not None and request.tree_nodes > cap:
        raise InvalidField(
            f"tree_nodes must be at most {cap} with this model: its cache holds {cap} tree nodes "
            f"per pass (got {request.tree_nodes})",
            param="tree_nodes",
        )
    depth = request.tree_depth or MAX_DEPTH  # the draft model reads up to width frontier nodes per depth
    if cap is not None and request.tree_width is not None and request.tree_width * depth > cap:
        raise InvalidField(
            f"tree_width x tree_depth must be at most {cap} with this model: its cache holds {cap} "
            f"tree nodes (got {request.tree_width} x {depth}; the depth is {MAX_DEPTH} at most "
            "when the cost model chooses it)",
            param="tree_width",
        )
    return request.tree_nodes or min(cap or FIXED_TREE_NODES, FIXED_TREE_NODES)


def _fit(drafter: TreeDrafter, parts: Parts, model: DraftModel | None) -> TreeDrafter:
    """The drafter's trees within what the caches of the models it runs hold (a batch slot: its share of ids)."""
    held = ids_held(parts.target, model)
    if held is not None:
        drafter.limit_tree(held)
    return drafter


def _lookup(parts: Parts, request) -> Lookup:
    from .drafters import Lookup, followed

    return Lookup(request.history, parts.datastore, copies=followed(request.prompt_ids, request.prediction_ids))


def build_lookup(parts: Parts, request) -> TreeDrafter:
    """Lookup guesses only, planned on the measured costs: no draft model (one chain where trees cannot run)."""
    from .planning.tree import TreeDrafter, TreeState

    drafter = TreeDrafter(
        None,
        lookup=_lookup(parts, request),
        costs=parts.costs(),
        state=TreeState(),
        chains_only=bool(tree_error(parts.target, None)),
    )
    return _fit(drafter, parts, None)


def build_auto(parts: Parts, request) -> TreeDrafter:
    """Plain steps, lookup, a draft chain or a tree, whichever the cost model expects to pay, step by step."""
    from .planning.tree import TreeDrafter, TreeState, draft_model_can_pay

    costs = parts.costs()
    model = (
        parts.draft_model
        if parts.draft_model is not None and draft_model_can_pay(costs, window=parts.draft_model.view_window)
        else None
    )
    state = TreeState()
    # the first steps run without the draft model, so that its measured rate is compared with a
    # measured rate of the steps without it (tree.TreeDrafter._learn_rate), not with a model of it
    state.plain_left = AUTO_PROBE_STEPS if model is not None else 0
    state.measure = True
    # lazy: the draft reads the text only when a step runs it, and a step runs it only when the
    # seconds it should save before max_new_tokens pay for that reading (tree.TreeDrafter._model_pays)
    drafter = TreeDrafter(
        model,
        pld=True,
        costs=costs,
        state=state,
        lookup=_lookup(parts, request),
        lazy=True,
        remaining=request.max_new_tokens,
        chains_only=bool(tree_error(parts.target, model)),
    )
    return _fit(drafter, parts, model)


def build_tree(parts: Parts, request) -> TreeDrafter:
    """A token tree of the draft model's guesses (where one is loaded) and lookup branches, of the shape asked."""
    from .planning.tree import TreeDrafter, TreeState

    error = tree_error(parts.target, parts.draft_model)
    if error:  # before any model work
        raise SpecDecodeError(error)
    draft_lm = parts.draft_model.lm if parts.draft_model is not None else None
    cap = tree_nodes_cap(request, (parts.target, draft_lm))
    drafter = TreeDrafter(
        parts.draft_model,
        pld=True,
        width=request.tree_width,
        depth=request.tree_depth,
        nodes=request.tree_nodes,
        costs=parts.costs(),
        state=TreeState(),
        lookup=_lookup(parts, request),
    )
    # passes no bigger than the caches hold (a copy's chain needs no tree-node ids)
    drafter.limit_tree(cap, ids_held(parts.target, parts.draft_model))
    return drafter


def build_pld(parts: Parts, request) -> PromptLookup:
    """Prompt lookup, following the prediction (where one was sent) through the output's edits."""
    from .drafters import PromptLookup, followed

    copies = followed((), request.prediction_ids, start=len(request.prompt_ids))
    return PromptLookup(prediction=copies[0] if copies else None)


def build_draft(parts: Parts, request) -> DraftModel:
    """The draft model itself: a chain of gamma guesses a step."""
    if parts.draft_model is None:
        raise InvalidField("method 'draft' needs a draft model (pass --draft / draft=...)", param="method")
    return parts.draft_model
