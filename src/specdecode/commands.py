"""`specdecode generate`, `certify`'s arguments, and what the commands that load models share: the
model, backend, lookup, speculation and sampling arguments, loading the engine, and the check that a command's
optional packages are installed. The commands of a package have their parser there (bench/cli.py, server/cli.py,
loadtest/cli.py, apply/cli.py, drafters/datastore.py); cli.py dispatches.
No torch here: every command's parser is built before anything loads it."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from .errors import SpecDecodeError
from .host import MODEL_IMPORTS, import_frozen

# what `specdecode serve` and `specdecode bench` import beyond the core, and the extra that installs it
EXTRAS = {"serve": ("server", ("fastapi", "starlette", "uvicorn", "prometheus_client", "pydantic", "anyio")),
          "bench": ("bench", ("matplotlib",)), "serve --ray": ("ray", ("ray",))}


def require_extra(command: str) -> None:
    extra, modules = EXTRAS[command]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SpecDecodeError(f"`specdecode {command}` needs {', '.join(missing)}, which is not installed: "
                              f"pip install \"specdecode[{extra}]\" (from a checkout: pip install -e \".[{extra}]\")")


def add_generate_parser(sub) -> None:
    """`specdecode generate`"""
    g = sub.add_parser("generate", help="generate text from a prompt (streamed), then print stats")
    g.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--prediction", default=None, metavar="FILE",
                   help="a file holding the text the answer is expected to repeat, mostly ('-': stdin), as OpenAI's "
                        "Predicted Outputs: a source of guesses the target verifies, never a forced output")
    speculation_args(g)
    sampling_args(g)
    g.add_argument("--stop", nargs="+", default=None, metavar="STR", help="stop strings")
    model_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    g.set_defaults(run=generate)


def speculation_args(parser) -> None:
    """--method, --gamma and the tree's dimensions: how a command's generations speculate."""
    from .methods import DEFAULT_GAMMA, DEFAULT_METHOD, help_text, method_names
    parser.add_argument("--method", choices=method_names(), default=DEFAULT_METHOD, help=help_text())
    parser.add_argument("--gamma", type=int, default=DEFAULT_GAMMA,
                        help=f"draft tokens per target pass (default {DEFAULT_GAMMA})")
    tree_args(parser)


def sampling_args(parser, max_new_tokens: int | None = 128, help: str | None = None) -> None:
    """--max-new-tokens, --temperature, --top-k, --top-p, --seed."""
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=help)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)


def model_args(parser) -> None:
    """The models a command loads and how: --target, --draft, --dtype, --device, the backend and lookup arguments."""
    parser.add_argument("--target", default=None, help="built-in name, HF directory, .gguf file or hub id "
                                                       "(default: qwen2.5-coder-1.5b-instruct)")
    parser.add_argument("--draft", default=None, help="draft model, same forms (default with the default target: "
                                                      "qwen2.5-coder-0.5b-instruct)")
    parser.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default=None,
                        help="default: bf16 where the hardware supports it natively, else fp32")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    backend_args(parser)
    lookup_args(parser)


def load_engine(args, methods: list[str], progress: bool = True):
    """The Engine (or the Router, with --route) that model_args describe, with a draft model where one of `methods`
    can use it. Loads torch and the models: seconds to a minute."""
    import_frozen(MODEL_IMPORTS)
    from .methods import wants_draft_model
    from .routing import loader
    return loader(args.route)(args.target, args.draft, backend=args.backend, dtype=args.dtype, device=args.device,
                              threads=args.threads, with_draft=wants_draft_model(methods), progress=progress,
                              draft_quant=args.draft_quant, draft_vocab=args.draft_vocab,
                              draft_vocab_from=args.draft_vocab_from, draft_window=args.draft_window or None,
                              exact=args.exact, datastore=args.datastore)


def add_certify_parser(sub) -> None:
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
    backend_args(c)
    c.add_argument("--json", action="store_true", help="print the certificate as JSON")
    c.add_argument("--out", default=None, help="directory for certificate.json and certificate.md")
    c.set_defaults(run=_certify)


def _certify(args) -> int:
    import_frozen(MODEL_IMPORTS)
    from .certify import certify_command
    return certify_command(args)


def backend_args(parser) -> None:
    from .drafters import DRAFT_WINDOW
    from .backends import BACKENDS, DRAFT_QUANT_CHOICES
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto (default): GGUF models on the CPU run on llama.cpp, the rest on torch")
    parser.add_argument("--route", action="store_true",
                        help="a GGUF target on llama.cpp and also on torch in bf16 (where this CPU's bf16 passes "
                             "measure flat and memory allows), each request run whole on the one its measured costs "
                             "predict faster (an edit with a prediction: often torch; a chat: llama.cpp)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all this process may use)")
    parser.add_argument("--draft-quant", choices=DRAFT_QUANT_CHOICES, default="auto",
                        help="llama.cpp: run the draft in its fastest type here (auto, measured once), keep the "
                             "file's (none) or force one; the draft never changes the output's law")
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


def lookup_args(parser, history: bool = False, history_default: int = 0) -> None:
    parser.add_argument("--datastore", default=None, metavar="DIR",
                        help="a datastore built by `specdecode index`: the lookup, tree and auto methods draft from it")
    if history:
        parser.add_argument("--history-tokens", type=int, default=history_default,
                            help=f"earlier outputs remembered for the lookup drafter (default {history_default:,} "
                                 "tokens, least recently used dropped first; 0: none, and output then never depends "
                                 "on earlier requests)")


def tree_args(parser) -> None:
    t = parser.add_argument_group("method tree (each unset dimension is chosen by the cost model)")
    t.add_argument("--tree-width", type=int, default=None, help="children per node and nodes expanded per depth")
    t.add_argument("--tree-depth", type=int, default=None, help="depth of the tree (draft passes)")
    t.add_argument("--tree-nodes", type=int, default=None, help="draft tokens verified per target pass")


def tree_kwargs(args) -> dict:
    kw = {f"tree_{k}": getattr(args, f"tree_{k}") for k in ("width", "depth", "nodes")}
    return {k: v for k, v in kw.items() if v is not None}


def generate(args) -> None:
    """The Engine's checks judge the arguments (SpecDecodeError: exit 2 with its message), before torch and the
    models load (seconds to a minute)."""
    from .checks import check_request
    if args.prompt == "-" and args.prediction == "-":
        raise SpecDecodeError("the prompt and --prediction cannot both be read from stdin")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    prediction = None
    if args.prediction is not None:
        try:
            prediction = sys.stdin.read() if args.prediction == "-" else Path(args.prediction).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise SpecDecodeError(f"--prediction: cannot read {args.prediction}: {e}") from None
    check_request(method=args.method, gamma=args.gamma, max_new_tokens=args.max_new_tokens,
                 temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, stop=args.stop, **tree_kwargs(args))
    engine = load_engine(args, [args.method], progress=not args.json)
    stream = engine.stream(prompt, method=args.method, gamma=args.gamma, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                           stop=args.stop, chat=args.chat, prediction=prediction, **tree_kwargs(args))
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
    if prediction is not None:  # OpenAI's usage fields (specdecode.prediction), as the server reports them
        sys.stderr.write(f"prediction: {s.accepted_prediction_tokens} tokens accepted, "
                         f"{s.rejected_prediction_tokens} rejected\n")

