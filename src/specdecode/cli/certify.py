"""`specdecode certify`: a certificate that speculation is lossless on your models and machine (the checks:
certify.py)."""

from __future__ import annotations

import json

from ..errors import SpecDecodeError
from ..host import MODEL_IMPORTS, import_frozen
from .args import DTYPES, backend_args


def add_parser(sub) -> None:
    """`specdecode certify`"""
    from ..methods import BASELINE, in_default_run

    c = sub.add_parser(
        "certify",
        help="certify on your own model pair and machine that speculation here is lossless "
        "(KV rollback, the verifier on real p/q rows, greedy agreement)",
    )
    c.add_argument("--target", default=None, help="as for generate (default: the default pair)")
    c.add_argument("--draft", default=None, help="as for generate")
    checked = ",".join(in_default_run("certify_default"))
    c.add_argument(
        "--methods",
        default=checked,
        help=f"comma-separated methods to check against plain decoding (default: {checked}; any but {BASELINE})",
    )
    c.add_argument("--draws", type=int, default=10**6, help="verifier draws per prompt and setting (default 10^6)")
    c.add_argument("--max-new-tokens", type=int, default=48, help="tokens per greedy comparison (default 48)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--dtype", choices=DTYPES, default=None)
    c.add_argument("--device", default=None)
    backend_args(c)
    c.add_argument("--json", action="store_true", help="print the certificate as JSON")
    c.add_argument("--out", default=None, help="directory for certificate.json and certificate.md")
    c.set_defaults(run=certify_command)


def certify_command(args) -> int:
    """`specdecode certify`: 0 when the certificate passed, 1 when a check failed."""
    import sys

    import_frozen(MODEL_IMPORTS)
    from ..certify import certify, markdown, write
    from ..engine import Engine
    from ..host import cpu_description
    from ..methods import METHOD_TABLE, REQUIRED, names_where

    drafting = names_where(drafts=True)  # every method but plain decoding, the yardstick
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in drafting]
    if bad or not methods:
        raise SpecDecodeError(
            f"unknown method(s) {', '.join(bad) or '(none)'} for certify; choose from {', '.join(drafting)}"
        )
    if args.draws < 1000 or args.max_new_tokens <= 0:
        raise SpecDecodeError("--draws must be at least 1000 and --max-new-tokens positive")
    if args.route or args.remeasure_route:
        raise SpecDecodeError("certify checks one engine at a time; drop --route (or check each --backend)")
    engine = Engine.load(
        args.target,
        args.draft,
        backend=args.backend,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        draft_quant=args.draft_quant,
        draft_vocab=args.draft_vocab,
        draft_vocab_from=args.draft_vocab_from,
        draft_window=args.draft_window or None,
        exact=args.exact,
        progress=not args.json,
    )
    if engine.draft_model is None:
        methods = [m for m in methods if METHOD_TABLE[m].needs_draft_model != REQUIRED]
    report = certify(
        engine,
        methods=methods,
        draws=args.draws,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        progress=not args.json,
    )
    report["cpu"] = cpu_description()
    if args.out:
        write(report, args.out)
    if args.json:
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(markdown(report) + (f"\nwritten to {args.out}/\n" if args.out else ""))
    return 0 if report["passed"] else 1
