"""`specdecode generate PROMPT`: stream a generation, then a stats line (or one JSON object)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import SpecDecodeError
from .args import model_args, sampling_args, speculation_args, tree_kwargs
from .load import load_engine


def add_parser(sub) -> None:
    """`specdecode generate`"""
    g = sub.add_parser("generate", help="generate text from a prompt (streamed), then print stats")
    g.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument(
        "--prediction",
        default=None,
        metavar="FILE",
        help="a file holding the text the answer is expected to repeat, mostly ('-': stdin), as OpenAI's "
        "Predicted Outputs: a source of guesses the target verifies, never a forced output",
    )
    speculation_args(g)
    sampling_args(g)
    g.add_argument("--stop", nargs="+", default=None, metavar="STR", help="stop strings")
    model_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    g.set_defaults(run=generate)


def generate(args) -> None:
    """The Engine's checks judge the arguments (SpecDecodeError: exit 2 with its message), before torch and the
    models load (seconds to a minute)."""
    from ..checks import check_request
    from ..request import Request

    if args.prompt == "-" and args.prediction == "-":
        raise SpecDecodeError("the prompt and --prediction cannot both be read from stdin")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    prediction = None
    if args.prediction is not None:
        try:
            prediction = sys.stdin.read() if args.prediction == "-" else Path(args.prediction).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise SpecDecodeError(f"--prediction: cannot read {args.prediction}: {e}") from None
    request = Request(
        prompt,
        method=args.method,
        gamma=args.gamma,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        chat=args.chat,
        prediction=prediction,
        **tree_kwargs(args),
    )
    check_request(**request.checked_fields())
    engine = load_engine(args, [args.method], progress=not args.json)
    stream = engine.open(request)
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
    shape = (
        f"gamma={s.gamma}"
        if s.tree is None
        else ", ".join(f"{k} {v}" for k, v in s.strategies.items())
        if s.method == "auto"
        else (
            f"nodes/pass {s.mean_tree_nodes or 0:.1f}, depth/pass {s.tree_depth / max(1, s.target_forwards):.1f}, "
            f"expected tokens/pass {s.expected_tokens_per_pass or 0:.2f}"
        )
    )
    sys.stderr.write(
        f"[{s.method} {shape}] {s.new_tokens} tokens in {s.wall_s:.2f}s "
        f"({s.tokens_per_second or 0:.2f} tok/s) | target forwards {s.target_forwards} | "
        f"accepted {s.accepted}/{s.drafted} ({rate}) | "
        f"tokens per target forward {s.mean_accepted_tokens or 0:.2f} | "
        f"draft {s.draft_s:.2f}s verify {s.verify_s:.2f}s | finish: {s.finish_reason} | "
        f"backend {engine.backend}\n"
    )
    if prediction is not None:  # OpenAI's usage fields (specdecode.prediction), as the server reports them
        sys.stderr.write(
            f"prediction: {s.accepted_prediction_tokens} tokens accepted, {s.rejected_prediction_tokens} rejected\n"
        )
