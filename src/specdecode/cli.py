"""Command line: `specdecode generate ...` (and `python -m specdecode ...`).

Nothing here imports torch at module level: main() restarts the command for huge pages (host/hugepages.py)
before any command's parser or code loads it."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from .errors import SpecDecodeError
from .host import restart_if_command


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors: one line on stderr, exit status 2
        sys.stderr.write(f"specdecode: error: {message}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdecode", description="Lossless speculative decoding for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_generate_parser, _bench_parser, _serve_parser, _index_parser, _certify_parser, _loadtest_parser):
        add(sub)
    return parser


def _generate_parser(sub) -> None:
    """`specdecode generate`"""
    from .methods import DEFAULT_METHOD, help_text, method_names
    g = sub.add_parser("generate", help="generate text from a prompt (streamed), then print stats")
    g.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--prediction", default=None, metavar="FILE",
                   help="a file holding the text the answer is expected to repeat, mostly ('-': stdin), as OpenAI's "
                        "Predicted Outputs: a source of guesses the target verifies, never a forced output")
    g.add_argument("--method", choices=method_names(), default=DEFAULT_METHOD, help=help_text())
    g.add_argument("--gamma", type=int, default=4, help="draft tokens per target pass (default 4)")
    _tree_args(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", nargs="+", default=None, metavar="STR", help="stop strings")
    g.add_argument("--target", default=None, help="built-in name, HF directory, .gguf file or hub id "
                                                  "(default: qwen2.5-coder-1.5b-instruct)")
    g.add_argument("--draft", default=None, help="draft model, same forms (default with the default target: "
                                                 "qwen2.5-coder-0.5b-instruct)")
    g.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None,
                   help="default: bf16 where the hardware supports it natively, else fp32")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    _backend_args(g)
    _lookup_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")


def _bench_parser(sub) -> None:
    """`specdecode bench`"""
    from .bench import PEERS
    from .methods import in_default_run, method_names
    methods = method_names()
    b = sub.add_parser("bench", help="benchmark methods against plain decoding (and HF assisted generation)")
    b.add_argument("--prompts", required=True, help="JSONL file: 'prompt' (completion) or 'turns' (chat) per line")
    b.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    b.add_argument("--methods", default=None,
                   help=f"comma-separated: {','.join(methods)},{PEERS[0]} (torch),{','.join(PEERS[1:])} "
                        f"(llama.cpp peers; default: {','.join(sorted(in_default_run('bench_default')))} and "
                        "the backend's peers)")
    b.add_argument("--gamma", type=int, default=4, help="draft tokens per pass of the chain methods")
    _tree_args(b)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--target", default=None)
    b.add_argument("--draft", default=None)
    b.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None)
    b.add_argument("--device", default=None)
    _backend_args(b)
    _lookup_args(b, history=True, history_default=0)
    b.add_argument("--all-turns", action="store_true", help="chat prompts with several turns: run every turn, "
                                                              "as one conversation per prompt")
    b.add_argument("--llama-server", default=None, metavar="PATH", help="the llama-server binary of the "
                   "llama-server peers (default: specdecode loadtest --build-llama-server's cached build, then PATH)")
    b.add_argument("--out", default="bench-out", help="directory for results.json, report.md, *.png")


def _serve_parser(sub) -> None:
    """`specdecode serve`"""
    from .methods import DEFAULT_METHOD, method_names
    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--method", choices=method_names(), default=DEFAULT_METHOD, help="default speculation (per request: "
                                                                       "'speculation': {'method', 'gamma'})")
    s.add_argument("--gamma", type=int, default=4, help="draft tokens per target pass (default 4)")
    s.add_argument("--target", default=None, help="as for generate (default: qwen2.5-coder-1.5b-instruct)")
    s.add_argument("--draft", default=None, help="as for generate")
    s.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None)
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    _backend_args(s)
    _lookup_args(s, history=True, history_default=0)  # off unless enabled: then kept per API key, outputs only
    s.add_argument("--no-prompt-cache", action="store_true",
                   help="read every prompt whole (default: a prompt that starts as the last one of the same API key "
                        "on that slot did, such as a chat's system prompt or earlier turns, reads only what is new; "
                        "greedy output can then differ from a fresh read at a near-tie, as llama-server's cache_prompt)")
    s.add_argument("--speculation-sources", action="store_true",
                   help="responses carry per-source draft counts (with --history-tokens they tell of other outputs)")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: the target's name)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECDECODE_API_KEY, else none)")
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


def _loadtest_parser(sub) -> None:
    """`specdecode loadtest` (its arguments: loadtest/cli.py)"""
    from .loadtest.cli import add_parser
    add_parser(sub)


def _index_parser(sub) -> None:
    """`specdecode index`"""
    i = sub.add_parser("index", help="build a datastore from your files for the lookup drafter (--datastore DIR)")
    i.add_argument("paths", nargs="+", metavar="PATH", help="files, and directories searched for text files")
    i.add_argument("--out", required=True, help="directory for the datastore")
    i.add_argument("--target", default=None, help="the model whose tokenizer to use (default: the default target)")
    i.add_argument("--suffixes", default=None, help="comma-separated file suffixes to take from directories "
                                                    "(default: common code and text files, e.g. .py,.md,.txt)")


def _certify_parser(sub) -> None:
    """`specdecode certify`"""
    from .methods import BASELINE, in_default_run
    c = sub.add_parser("certify", help="certify on your own model pair and machine that speculation here is lossless "
                                        "(KV rollback, the verifier on real p/q rows, greedy agreement)")
    c.add_argument("--target", default=None, help="as for generate (default: the default pair)")
    c.add_argument("--draft", default=None, help="as for generate")
    checked = ",".join(in_default_run("certify_default"))
    c.add_argument("--methods", default=checked, help="comma-separated methods to check against plain decoding "
                                                      f"(default: {checked}; any but {BASELINE})")
    c.add_argument("--draws", type=int, default=10 ** 6, help="verifier draws per prompt and setting (default 10^6)")
    c.add_argument("--max-new-tokens", type=int, default=48, help="tokens per greedy comparison (default 48)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None)
    c.add_argument("--device", default=None)
    _backend_args(c)
    c.add_argument("--json", action="store_true", help="print the certificate as JSON")
    c.add_argument("--out", default=None, help="directory for certificate.json and certificate.md")


def certify(args) -> int:
    from . import certify as cert
    from .bench import cpu_description
    from .engine import Engine
    from .methods import METHOD_TABLE, REQUIRED, names_where
    drafting = names_where(drafts=True)  # every method but plain decoding, the yardstick
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in drafting]
    if bad or not methods:
        raise SpecDecodeError(f"unknown method(s) {', '.join(bad) or '(none)'} for certify; choose from "
                              f"{', '.join(drafting)}")
    if args.draws < 1000 or args.max_new_tokens <= 0:
        raise SpecDecodeError("--draws must be at least 1000 and --max-new-tokens positive")
    if args.route:
        raise SpecDecodeError("certify checks one engine at a time; drop --route (or check each --backend)")
    engine = Engine.load(args.target, args.draft, backend=args.backend, dtype=args.dtype, device=args.device,
                         threads=args.threads, draft_quant=args.draft_quant, draft_vocab=args.draft_vocab,
                         draft_vocab_from=args.draft_vocab_from, draft_window=args.draft_window or None, exact=args.exact, progress=not args.json)
    if engine.draft_model is None:
        methods = [m for m in methods if METHOD_TABLE[m].needs_draft_model != REQUIRED]
    report = cert.certify(engine, methods=methods, draws=args.draws, max_new_tokens=args.max_new_tokens,
                          seed=args.seed, progress=not args.json)
    report["cpu"] = cpu_description()
    if args.out:
        cert.write(report, args.out)
    if args.json:
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(cert.markdown(report) + (f"\nwritten to {args.out}/\n" if args.out else ""))
    return 0 if report["passed"] else 1


def _backend_args(parser) -> None:
    from .drafters import DRAFT_WINDOW
    from .backends import BACKENDS
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto (default): GGUF models on the CPU run on llama.cpp, the rest on torch")
    parser.add_argument("--route", action="store_true",
                        help="a GGUF target on llama.cpp and also on torch in bf16 (where this CPU's bf16 passes "
                             "measure flat and memory allows), each request run whole on the one its measured costs "
                             "predict faster (an edit with a prediction: often torch; a chat: llama.cpp)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all this process may use)")
    parser.add_argument("--draft-quant", choices=["auto", "none", "Q4_0", "Q8_0"], default="auto",
                        help="llama.cpp: run the draft in its fastest type here (auto, measured once), keep the "
                             "file's (none) or force one; the draft never changes the output")
    parser.add_argument("--draft-vocab", type=int, default=None, metavar="K",
                        help="torch: keep only the K most frequent tokens in the draft's output layer (FR-Spec; "
                             "frequencies from --draft-vocab-from or --datastore); a lighter draft, same output")
    parser.add_argument("--draft-vocab-from", default=None, metavar="DIR",
                        help="the datastore whose token frequencies choose --draft-vocab's tokens")
    parser.add_argument("--exact", action="store_true",
                        help="exact greedy mode: every token's logits bit-identical to plain decoding's, so the output "
                             "is plain decoding's token for token (llama.cpp: flash attention on; passes kept to the sizes "
                             "measured exact here; see the README)")
    parser.add_argument("--draft-window", type=int, default=DRAFT_WINDOW, metavar="N",
                        help=f"the draft model sees about the last N tokens of the text (default {DRAFT_WINDOW}; 0: all "
                             "of it): on a long prompt it reads a window, not the whole prompt; the output is the same")


def _lookup_args(parser, history: bool = False, history_default: int = 0) -> None:
    parser.add_argument("--datastore", default=None, metavar="DIR",
                        help="a datastore built by `specdecode index`: the lookup, tree and auto methods draft from it")
    if history:
        parser.add_argument("--history-tokens", type=int, default=history_default,
                            help=f"earlier outputs remembered for the lookup drafter (default {history_default:,} "
                                 "tokens, least recently used dropped first; 0: none, and output then never depends "
                                 "on earlier requests)")


def index(args) -> None:
    from .backends import DEFAULT_TARGET, load_tokenizer
    from .drafters.datastore import TEXT_SUFFIXES, index_files
    suffixes = TEXT_SUFFIXES
    if args.suffixes is not None:
        suffixes = tuple("." + x.strip().lstrip(".").lower() for x in args.suffixes.split(",") if x.strip())
        if not suffixes:
            raise SpecDecodeError("--suffixes is empty")
    tokenizer = load_tokenizer(args.target or DEFAULT_TARGET)
    meta = index_files(args.paths, tokenizer, args.out, suffixes=suffixes, info={"target": args.target or DEFAULT_TARGET})
    sys.stdout.write(f"datastore {args.out}: {meta['tokens']:,} tokens from {meta['documents']:,} documents "
                     f"({meta['files']:,} files)\n")


def _tree_args(parser) -> None:
    t = parser.add_argument_group("method tree (each unset dimension is chosen by the cost model)")
    t.add_argument("--tree-width", type=int, default=None, help="children per node and nodes expanded per depth")
    t.add_argument("--tree-depth", type=int, default=None, help="depth of the tree (draft passes)")
    t.add_argument("--tree-nodes", type=int, default=None, help="draft tokens verified per target pass")


def _tree_kwargs(args) -> dict:
    kw = {f"tree_{k}": getattr(args, f"tree_{k}") for k in ("width", "depth", "nodes")}
    return {k: v for k, v in kw.items() if v is not None}


def bench(args) -> None:
    from .bench import (check_methods, default_methods, load_prompts, needs_draft_model, parse_methods, report,
                        run_bench, write_outputs)
    from .bench.server_peer import check_server_peers
    from .engine import Engine
    from .methods import DEFAULT_METHOD, names_where
    methods = parse_methods(args.methods) if args.methods else None
    if args.limit is not None and args.limit <= 0:
        raise SpecDecodeError(f"--limit must be positive, got {args.limit}")
    prompts = load_prompts(args.prompts, args.limit, all_turns=args.all_turns)
    check_server_peers(methods or [], args.llama_server, args.temperature)  # before any model loads
    tree = _tree_kwargs(args)
    # the Engine's own checks, before the models load (a bad value would otherwise stop the run minutes in)
    shaped = names_where(tree_options=True)  # the methods that take the tree's dimensions
    Engine.check(method=shaped[0] if tree else DEFAULT_METHOD, gamma=args.gamma, max_new_tokens=args.max_new_tokens,
                 temperature=args.temperature, **tree)
    if tree and methods is not None and not set(shaped) & set(methods):
        raise SpecDecodeError(f"--tree-width/--tree-depth/--tree-nodes apply to method {' or '.join(shaped)}, "
                              "which is not benchmarked")
    from .routing import loader
    engine = loader(args.route)(args.target, args.draft, backend=args.backend, dtype=args.dtype, device=args.device,
                         threads=args.threads, draft_quant=args.draft_quant, draft_vocab=args.draft_vocab,
                         draft_vocab_from=args.draft_vocab_from, draft_window=args.draft_window or None, exact=args.exact, datastore=args.datastore,
                         history_tokens=args.history_tokens, with_draft=methods is None or needs_draft_model(methods))
    if methods is None:
        methods = default_methods(engine)
    check_methods(engine, methods)
    results = run_bench(engine, prompts, methods, gamma=args.gamma, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, seed=args.seed, tree=tree, llama_server=args.llama_server,
                        log_dir=f"{args.out}/logs")
    out = write_outputs(results, args.out)
    sys.stdout.write(report(results).split("\n## Per prompt")[0] + f"\nwritten to {out}/\n")


def generate(args) -> None:
    """The Engine checks the arguments (SpecDecodeError: exit 2 with its message). The sampling settings are
    checked by the Engine's own SamplingParams before the model load, which can take a minute."""
    from .engine import Engine
    from .methods import wants_draft_model
    if args.prompt == "-" and args.prediction == "-":
        raise SpecDecodeError("the prompt and --prediction cannot both be read from stdin")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    prediction = None
    if args.prediction is not None:
        try:
            prediction = sys.stdin.read() if args.prediction == "-" else Path(args.prediction).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise SpecDecodeError(f"--prediction: cannot read {args.prediction}: {e}") from None
    Engine.check(method=args.method, gamma=args.gamma, max_new_tokens=args.max_new_tokens,
                 temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, stop=args.stop, **_tree_kwargs(args))
    from .routing import loader
    engine = loader(args.route)(args.target, args.draft, backend=args.backend, dtype=args.dtype, device=args.device,
                         threads=args.threads, with_draft=wants_draft_model([args.method]), progress=not args.json,
                         draft_quant=args.draft_quant, draft_vocab=args.draft_vocab,
                         draft_vocab_from=args.draft_vocab_from, draft_window=args.draft_window or None, exact=args.exact, datastore=args.datastore)
    stream = engine.stream(prompt, method=args.method, gamma=args.gamma, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                           stop=args.stop, chat=args.chat, prediction=prediction, **_tree_kwargs(args))
    for delta in stream:
        if not args.json:
            sys.stdout.write(delta)
            sys.stdout.flush()
    result = stream.result
    if args.json:
        json.dump(result.as_dict(), sys.stdout)
        sys.stdout.write("\n")
        return
    s = result.stats
    rate = "n/a" if s.acceptance_rate is None else f"{s.acceptance_rate:.1%}"
    sys.stdout.write("\n")
    shape = f"gamma={s.gamma}" if s.tree is None else ", ".join(f"{k} {v}" for k, v in s.strategies.items()) \
        if s.method == "auto" else (
        f"nodes/pass {s.mean_tree_nodes or 0:.1f}, depth/pass {s.tree_depth / max(1, s.target_forwards):.1f}, "
        f"expected tokens/pass {s.expected_tokens_per_pass or 0:.2f}")
    sys.stderr.write(f"[{s.method} {shape}] {s.new_tokens} tokens in {s.wall_s:.2f}s "
                     f"({s.tokens_per_second or 0:.2f} tok/s) | target forwards {s.target_forwards} | "
                     f"accepted {s.accepted}/{s.drafted} ({rate}) | "
                     f"tokens per target forward {s.mean_accepted_tokens or 0:.2f} | "
                     f"draft {s.draft_s:.2f}s verify {s.verify_s:.2f}s | finish: {s.finish_reason} | backend {engine.backend}\n")
    if prediction is not None:
        src = s.sources.get("prediction", {"drafted": 0, "accepted": 0})
        sys.stderr.write(f"prediction: {src['accepted']} tokens accepted, {src['drafted'] - src['accepted']} rejected\n")


# what `specdecode serve` and `specdecode bench` import beyond the core, and the extra that installs it
EXTRAS = {"serve": ("server", ("fastapi", "starlette", "uvicorn", "prometheus_client", "pydantic", "anyio")),
          "bench": ("bench", ("matplotlib",)), "serve --ray": ("ray", ("ray",))}


def require_extra(command: str) -> None:
    extra, modules = EXTRAS[command]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SpecDecodeError(f"`specdecode {command}` needs {', '.join(missing)}, which is not installed: "
                              f"pip install \"specdecode[{extra}]\" (from a checkout: pip install -e \".[{extra}]\")")


def main(argv: list[str] | None = None) -> int:
    restart_if_command()  # the `specdecode` command runs itself again with huge pages, before torch loads
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            generate(args)
        elif args.command == "bench":
            require_extra("bench")
            bench(args)
        elif args.command == "certify":
            return certify(args)
        elif args.command == "index":
            index(args)
        elif args.command == "loadtest":
            from .loadtest.cli import loadtest
            return loadtest(args)
        elif args.command == "serve":
            require_extra("serve")
            if args.ray or args.replicas is not None or args.autoscale is not None:
                if not args.ray or (args.replicas is not None and args.autoscale is not None):
                    raise SpecDecodeError("--replicas and --autoscale go with --ray, and only one of them")
                require_extra("serve --ray")
                from .server import serve_ray
                return serve_ray(args) or 0
            from .server import serve
            serve(args)
    except SpecDecodeError as e:
        sys.stderr.write(f"specdecode: error: {' '.join(str(e).split())}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("specdecode: interrupted\n")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
