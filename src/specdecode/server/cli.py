"""`specdecode serve`: its arguments, and the choice between one server here (app.serve) and Ray Serve replicas
(ray_serve.serve_ray). Nothing here imports the server's packages until the command runs."""
from __future__ import annotations

from ..errors import SpecDecodeError
from ..host import MODEL_IMPORTS, import_frozen


def add_parser(sub) -> None:
    """`specdecode serve`"""
    from ..commands import backend_args, lookup_args
    from ..methods import DEFAULT_GAMMA, DEFAULT_METHOD, method_names
    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--method", choices=method_names(), default=DEFAULT_METHOD, help="default speculation (per request: "
                                                                       "'speculation': {'method', 'gamma'})")
    s.add_argument("--gamma", type=int, default=DEFAULT_GAMMA,
                   help=f"draft tokens per target pass (default {DEFAULT_GAMMA})")
    s.add_argument("--target", default=None, help="as for generate (default: qwen2.5-coder-1.5b-instruct)")
    s.add_argument("--draft", default=None, help="as for generate")
    s.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None)
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    backend_args(s)
    lookup_args(s, history=True, history_default=0)  # off unless enabled: then kept per API key, outputs only
    s.add_argument("--no-prompt-cache", action="store_true",
                   help="read every prompt whole (default: a prompt that starts as the last one of the same API key "
                        "on that slot did, such as a chat's system prompt or earlier turns, reads only what is new; "
                        "greedy output can then differ from a fresh read at a near-tie, as llama-server's cache_prompt)")
    s.add_argument("--speculation-sources", action="store_true",
                   help="responses carry per-source draft counts (with --history-tokens they tell of other outputs)")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: the target's name)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECDECODE_API_KEY, else none)")
    s.add_argument("--protect-all", action="store_true",
                   help="with an API key: /metrics and the API docs (/docs, /redoc, /openapi.json) need it too "
                        "(/health and the web page stay open)")
    s.add_argument("--max-queue", type=int, default=16, help="requests that may wait while one generates; "
                                                             "more get 503 with Retry-After (default 16)")
    s.add_argument("--timeout", type=float, default=300.0, help="longest a request may take, in seconds "
                                                                "(default 300)")
    s.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="the most tokens a request may generate, and the default (default: the context)")
    s.add_argument("--ctx-size", type=int, default=None, metavar="N",
                   help="the most tokens of prompt and output a request may use (default: the model's context; "
                        "with --parallel, each slot's, 4,096 cells less its tree room)")
    s.add_argument("--parallel", type=int, default=1, metavar="N",
                   help="generations served at once (continuous batching, llama.cpp: their passes are shared; "
                        "each slot holds --ctx-size tokens, its cache checked against the memory available); default 1")
    s.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="with --parallel: tokens of a prompt per pass while other generations decode, up to 512 "
                        "(bigger: first tokens sooner, the others' steps wait longer; default 512, one call)")
    r = s.add_argument_group("Ray Serve: replicas, on one machine or a Ray cluster (needs the ray extra)")
    r.add_argument("--ray", action="store_true", help="serve as Ray Serve replicas, each with its own models (on "
                                                      "$RAY_ADDRESS or a local `ray start`'s cluster, else a new one)")
    r.add_argument("--replicas", type=int, default=None, metavar="N", help="with --ray: N replicas (default 1)")
    r.add_argument("--autoscale", default=None, metavar="MIN,MAX",
                   help="with --ray: between MIN and MAX replicas, scaled on each one's queued and running requests")
    s.set_defaults(run=serve_command)


def serve_command(args) -> int | None:
    """One server here, or with --ray (--replicas, --autoscale) replicas on Ray Serve; each needs its extra."""
    from ..commands import require_extra
    require_extra("serve")
    if args.ray or args.replicas is not None or args.autoscale is not None:
        if not args.ray or (args.replicas is not None and args.autoscale is not None):
            raise SpecDecodeError("--replicas and --autoscale go with --ray, and only one of them")
        require_extra("serve --ray")
        from .ray_serve import serve_ray
        return serve_ray(args) or 0
    import_frozen(MODEL_IMPORTS)
    from .app import serve
    serve(args)
    return None
