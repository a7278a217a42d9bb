"""`specdecode serve`: its arguments and their checks, the models loaded, then one server here (server/app.py) or
Ray Serve replicas (server/ray_serve.py). Nothing here imports the server's packages until the command runs."""

from __future__ import annotations

import math
import os
import sys

from ..checks import positive_int
from ..errors import SpecDecodeError
from ..host import MODEL_IMPORTS, import_frozen
from .args import backend_args, lookup_args, method_args, models_args
from .extras import require_extra
from .load import load_engine


def add_parser(sub) -> None:
    """`specdecode serve`"""
    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    method_args(s, help="default speculation (per request: 'speculation': {'method', 'gamma'})")
    models_args(s)
    backend_args(s)
    lookup_args(s, history=True, history_default=0)  # off unless enabled: then kept per API key, outputs only
    s.add_argument(
        "--no-prompt-cache",
        action="store_true",
        help="read every prompt whole (default: a prompt that starts as the last one of the same API key "
        "on that slot did, such as a chat's system prompt or earlier turns, reads only what is new; "
        "greedy output can then differ from a fresh read at a near-tie, as llama-server's "
        "cache_prompt)",
    )
    s.add_argument(
        "--speculation-sources",
        action="store_true",
        help="responses carry per-source draft counts (with --history-tokens they tell of other outputs)",
    )
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: the target's name)")
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECDECODE_API_KEY, else none)",
    )
    s.add_argument(
        "--protect-all",
        action="store_true",
        help="with an API key: /metrics and the API docs (/docs, /redoc, /openapi.json) need it too "
        "(/health and the web page stay open)",
    )
    s.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="requests that may wait while one generates; more get 503 with Retry-After (default 16)",
    )
    s.add_argument("--timeout", type=float, default=300.0, help="longest a request may take, in seconds (default 300)")
    s.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the most tokens a request may generate, and the default (default: the context)",
    )
    s.add_argument(
        "--ctx-size",
        type=int,
        default=None,
        metavar="N",
        help="the most tokens of prompt and output a request may use (default: the model's context; "
        "with --parallel, each slot's, 4,096 cells less its tree room)",
    )
    s.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="generations served at once (continuous batching, llama.cpp: their passes are shared; "
        "each slot holds --ctx-size tokens, its cache checked against the memory available); default 1",
    )
    s.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="N",
        help="with --parallel: tokens of a prompt per pass while other generations decode, up to 512 "
        "(bigger: first tokens sooner, the others' steps wait longer; default 512, one call)",
    )
    r = s.add_argument_group("Ray Serve: replicas, on one machine or a Ray cluster (needs the ray extra)")
    r.add_argument(
        "--ray",
        action="store_true",
        help="serve as Ray Serve replicas, each with its own models (on "
        "$RAY_ADDRESS or a local `ray start`'s cluster, else a new one)",
    )
    r.add_argument("--replicas", type=int, default=None, metavar="N", help="with --ray: N replicas (default 1)")
    r.add_argument(
        "--autoscale",
        default=None,
        metavar="MIN,MAX",
        help="with --ray: between MIN and MAX replicas, scaled on each one's queued and running requests",
    )
    s.set_defaults(run=serve_command)


def serve_command(args) -> int | None:
    """One server here, or with --ray (--replicas, --autoscale) replicas on Ray Serve; each needs its extra."""
    require_extra("serve")
    if args.ray or args.replicas is not None or args.autoscale is not None:
        if not args.ray or (args.replicas is not None and args.autoscale is not None):
            raise SpecDecodeError("--replicas and --autoscale go with --ray, and only one of them")
        require_extra("serve --ray")
        return serve_ray(args) or 0
    import_frozen(MODEL_IMPORTS)
    serve(args)
    return None


def check_serve_args(args) -> str | None:
    """The server's own command-line settings (`serve`, `serve --ray`), checked before any model loads; returns
    the API key in force (--api-key, else $SPECDECODE_API_KEY, else None)."""
    from ..methods import REQUIRED, get_method
    from ..server.protocol import MAX_GAMMA

    if not 0 <= args.port <= 65535:
        raise SpecDecodeError(f"--port must be in 0..65535, got {args.port}")
    positive_int("--max-queue", args.max_queue)
    if not args.timeout > 0 or math.isinf(args.timeout):
        raise SpecDecodeError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    for flag, value, least in (
        ("--max-tokens", args.max_tokens, 1),
        ("--ctx-size", args.ctx_size, 2),
        ("--parallel", args.parallel, 1),
        ("--prefill-chunk", args.prefill_chunk, 1),
    ):
        if value is not None and value < least:
            raise SpecDecodeError(f"{flag} must be at least {least}, got {value}")
    if (args.prefill_chunk or 0) > 512:
        raise SpecDecodeError(f"--prefill-chunk must be at most 512 (one llama_decode call), got {args.prefill_chunk}")
    if args.parallel > 1 and args.exact:
        raise SpecDecodeError(
            "--exact serves one request at a time: with --parallel, llama.cpp places the cache cells "
            "of several generations itself, so attention may sum in another order than alone"
        )
    if not 1 <= args.gamma <= MAX_GAMMA:
        raise SpecDecodeError(f"--gamma must be in 1..{MAX_GAMMA} (this server's limit), got {args.gamma}")
    if get_method(args.method).needs_draft_model == REQUIRED and args.target is not None and args.draft is None:
        raise SpecDecodeError(
            f"method {args.method!r} needs a draft model (--draft); or use --method pld / autoregressive"
        )
    if args.api_key is not None and not args.api_key:
        raise SpecDecodeError("--api-key must not be empty")
    api_key = args.api_key if args.api_key is not None else os.environ.get("SPECDECODE_API_KEY") or None
    if args.protect_all and api_key is None:
        raise SpecDecodeError("--protect-all needs an API key (--api-key or $SPECDECODE_API_KEY)")
    return api_key


def load_served(args):
    """The models `serve` answers with, measured before the first request: pass costs (any request may ask for a
    method that uses them), --ctx-size applied (to every engine of a router), exact pass sizes with --exact; and
    with --parallel the slots."""
    from ..server.app import limit_context

    engine = load_engine(
        args, [args.method], any_method=True, history_tokens=args.history_tokens, prompt_cache=not args.no_prompt_cache
    )  # per API key (Service._scope); slots copy it
    engine.tree_costs()  # measure pass costs now (once per machine)
    if args.ctx_size is not None:  # after measuring, which times passes at long contexts
        limit_context(engine, args.ctx_size)
    if args.exact:
        engine.exact_limits()  # measure the exact pass sizes now (once per machine), not in the first request
    slots = None
    if args.parallel > 1:
        from ..slots import Slots

        slots = Slots(engine, args.parallel, prefill_chunk=args.prefill_chunk, context=args.ctx_size)
    return engine, slots


def serve(args) -> None:
    """`specdecode serve`: load the models, then run uvicorn until interrupted."""
    from ..backends import DEFAULT_TARGET
    from ..server.app import create_app, is_loopback, model_name, run

    api_key = check_serve_args(args)  # before a model load that can take a minute
    model_id = args.served_model_name or model_name(args.target or DEFAULT_TARGET)
    engine, slots = load_served(args)
    app = create_app(
        engine,
        model_id=model_id,
        method=args.method,
        gamma=args.gamma,
        api_key=api_key,
        protect_all=args.protect_all,
        max_queue=args.max_queue,
        timeout_s=args.timeout,
        max_tokens_cap=args.max_tokens,
        show_sources=args.speculation_sources,
        slots=slots,
    )
    if not is_loopback(args.host) and api_key is None:
        sys.stderr.write(f"specdecode: warning: listening on {args.host} without an API key (--api-key)\n")
    sys.stderr.write(
        f"specdecode: serving {model_id!r} at http://{args.host}:{args.port}/v1 "
        f"(method {args.method}, gamma {args.gamma}, backend {engine.backend}, "
        f"{args.parallel} at once"
        + (f", prompts read {slots.prefill_chunk} tokens a pass beside others' decoding" if slots else "")
        + ")\n"
    )
    run(app, args.host, args.port)


def serve_ray(args) -> None:
    """`specdecode serve --ray`: the replicas on Ray Serve, until interrupted."""
    from ..server.ray_serve import parse_autoscale, ray_app, run_ray

    api_key = check_serve_args(args)  # the same settings as `serve`'s, before Ray starts
    if args.parallel > 1:
        raise SpecDecodeError(
            "--parallel is not available inside Ray replicas yet: scale with --replicas or --autoscale"
        )
    if args.route:
        raise SpecDecodeError(
            "--route is not available inside Ray replicas: each replica loads one engine (drop "
            "--route, or serve it without --ray)"
        )
    autoscale = parse_autoscale(args.autoscale) if args.autoscale else None
    most = autoscale[1] if autoscale else (args.replicas or 1)
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // most)
    app = ray_app(
        args.target,
        args.draft,
        method=args.method,
        gamma=args.gamma,
        replicas=args.replicas or 1,
        autoscale=autoscale,
        threads=threads,
        served_model_name=args.served_model_name,
        api_key=api_key,
        protect_all=args.protect_all,
        max_queue=args.max_queue,
        timeout_s=args.timeout,
        show_sources=args.speculation_sources,
        max_tokens_cap=args.max_tokens,
        ctx_size=args.ctx_size,
        backend=args.backend,
        dtype=args.dtype,
        device=args.device,
        draft_quant=args.draft_quant,
        draft_vocab=args.draft_vocab,
        draft_vocab_from=args.draft_vocab_from,
        draft_window=args.draft_window or None,
        exact=args.exact,
        datastore=args.datastore,
        history_tokens=args.history_tokens,
        prompt_cache=not args.no_prompt_cache,
    )
    scale = f"{autoscale[0]}..{autoscale[1]} replicas (autoscaled)" if autoscale else f"{args.replicas or 1} replica(s)"
    run_ray(app, args.host, args.port, f"{scale} x {threads} thread(s)", f"method {args.method}, gamma {args.gamma}")
