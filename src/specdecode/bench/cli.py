"""`specdecode bench`: its arguments and the command (the run itself: run.py)."""

from __future__ import annotations

import sys

from ..errors import SpecDecodeError
from ..host import MODEL_IMPORTS, import_frozen


def add_parser(sub) -> None:
    """`specdecode bench`"""
    from ..cli.args import backend_args, gamma_arg, lookup_args, models_args, tree_args
    from ..methods import in_default_run, method_names
    from .peers import PEERS

    methods = method_names()
    b = sub.add_parser("bench", help="benchmark methods against plain decoding (and HF assisted generation)")
    b.add_argument("--prompts", required=True, help="JSONL file: 'prompt' (completion) or 'turns' (chat) per line")
    b.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    b.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated: {','.join(methods)},{PEERS[0]} (torch),{','.join(PEERS[1:])} "
        f"(llama.cpp peers; default: {','.join(sorted(in_default_run('bench_default')))} and "
        "the backend's peers)",
    )
    gamma_arg(b, help="draft tokens per pass of the chain methods")
    tree_args(b)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--seed", type=int, default=0)
    models_args(b)
    backend_args(b)
    lookup_args(b, history=True, history_default=0)
    b.add_argument(
        "--all-turns",
        action="store_true",
        help="chat prompts with several turns: run every turn, as one conversation per prompt",
    )
    b.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="the llama-server binary of the "
        "llama-server peers (default: specdecode loadtest --build-llama-server's cached build, then PATH)",
    )
    b.add_argument("--out", default="bench-out", help="directory for results.json, report.md, *.png")
    b.set_defaults(run=bench)


def bench(args) -> None:
    from ..checks import positive_int
    from ..cli.args import tree_kwargs
    from ..cli.extras import require_extra

    require_extra("bench")
    import_frozen(MODEL_IMPORTS)
    from ..engine import Engine
    from ..methods import DEFAULT_METHOD, names_where
    from . import (
        check_methods,
        default_methods,
        load_prompts,
        needs_draft_model,
        parse_methods,
        report,
        run_bench,
        write_outputs,
    )
    from .server_peer import check_server_peers

    methods = parse_methods(args.methods) if args.methods else None
    if args.limit is not None:
        positive_int("--limit", args.limit)
    prompts = load_prompts(args.prompts, args.limit, all_turns=args.all_turns)
    check_server_peers(methods or [], args.llama_server, args.temperature)  # before any model loads
    tree = tree_kwargs(args)
    # the Engine's own checks, before the models load (a bad value would otherwise stop the run minutes in)
    shaped = names_where(tree_options=True)  # the methods that take the tree's dimensions
    Engine.check(
        method=shaped[0] if tree else DEFAULT_METHOD,
        gamma=args.gamma,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        **tree,
    )
    if tree and methods is not None and not set(shaped) & set(methods):
        raise SpecDecodeError(
            f"--tree-width/--tree-depth/--tree-nodes apply to method {' or '.join(shaped)}, which is not benchmarked"
        )
    from ..cli.load import load_kwargs
    from ..routing import loader

    engine = loader(args.route)(
        args.target,
        args.draft,
        history_tokens=args.history_tokens,
        with_draft=methods is None or needs_draft_model(methods),
        **load_kwargs(args),
    )
    if methods is None:
        methods = default_methods(engine)
    check_methods(engine, methods)
    results = run_bench(
        engine,
        prompts,
        methods,
        gamma=args.gamma,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        tree=tree,
        llama_server=args.llama_server,
        log_dir=f"{args.out}/logs",
    )
    out = write_outputs(results, args.out)
    sys.stdout.write(report(results).split("\n## Per prompt")[0] + f"\nwritten to {out}/\n")
