"""`specdecode index PATH... --out DIR`: a datastore of your files for the lookup drafter (drafters/datastore.py)."""

from __future__ import annotations

from ..errors import SpecDecodeError


def add_parser(sub) -> None:
    """`specdecode index`"""
    i = sub.add_parser("index", help="build a datastore from your files for the lookup drafter (--datastore DIR)")
    i.add_argument("paths", nargs="+", metavar="PATH", help="files, and directories searched for text files")
    i.add_argument("--out", required=True, help="directory for the datastore")
    i.add_argument("--target", default=None, help="the model whose tokenizer to use (default: the default target)")
    i.add_argument(
        "--suffixes",
        default=None,
        help="comma-separated file suffixes to take from directories "
        "(default: common code and text files, e.g. .py,.md,.txt)",
    )
    i.set_defaults(run=index_command)


def index_command(args) -> None:
    """`specdecode index`: the datastore of `args.paths`, tokenized by the target's tokenizer."""
    import sys

    from ..backends import DEFAULT_TARGET, load_tokenizer
    from ..drafters.datastore import TEXT_SUFFIXES, index_files

    suffixes = TEXT_SUFFIXES
    if args.suffixes is not None:
        suffixes = tuple("." + x.strip().lstrip(".").lower() for x in args.suffixes.split(",") if x.strip())
        if not suffixes:
            raise SpecDecodeError("--suffixes is empty")
    tokenizer = load_tokenizer(args.target or DEFAULT_TARGET)
    meta = index_files(
        args.paths, tokenizer, args.out, suffixes=suffixes, info={"target": args.target or DEFAULT_TARGET}
    )
    sys.stdout.write(
        f"datastore {args.out}: {meta['tokens']:,} tokens from {meta['documents']:,} documents "
        f"({meta['files']:,} files)\n"
    )
