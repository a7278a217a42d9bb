"""The models a command's arguments name (args.models_args, backend_args, lookup_args), loaded: the Engine, or
with --route the Router. Loads torch and the models: seconds to a minute."""

from __future__ import annotations

from ..errors import SpecDecodeError
from ..host import MODEL_IMPORTS, import_frozen


def load_kwargs(args) -> dict:
    """The Engine.load (with --route Router.load) arguments that the model, backend and lookup arguments give."""
    if args.remeasure_route and not args.route:
        raise SpecDecodeError("--remeasure-route goes with --route: it times what --route chooses by")
    route = {"remeasure": True} if args.remeasure_route else {}
    return dict(
        backend=args.backend,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        draft_quant=args.draft_quant,
        draft_vocab=args.draft_vocab,
        draft_vocab_from=args.draft_vocab_from,
        draft_window=args.draft_window or None,
        exact=args.exact,
        datastore=args.datastore,
        **route,
    )


def load_engine(args, methods: list[str], progress: bool = True, any_method: bool = False, **more):
    """The Engine (or the Router, with --route) that the arguments describe, with a draft model where one of
    `methods` can use it (with `any_method`, as a server whose requests choose theirs: also where --draft names
    one). `more`: further Engine.load arguments (a server's history and prompt cache)."""
    import_frozen(MODEL_IMPORTS)
    from ..methods import wants_draft_model
    from ..routing import loader

    with_draft = wants_draft_model(methods) or (any_method and args.draft is not None)
    return loader(args.route)(
        args.target, args.draft, with_draft=with_draft, progress=progress, **load_kwargs(args), **more
    )
