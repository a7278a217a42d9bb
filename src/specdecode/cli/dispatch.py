"""The command line's dispatch: `specdecode COMMAND ...` (and `python -m specdecode ...`). Each command's parser
and code live in a module of its own (`add_parser` there sets the function that runs it): generate, serve, index and
certify in this package, apply, bench and loadtest in theirs.

Nothing here imports torch at module level: main() restarts the command for huge pages (host/hugepages.py)
before any command's parser or code loads it."""

from __future__ import annotations

import argparse
import sys

from ..errors import SpecDecodeError
from ..host import restart_if_command


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors: one line on stderr, exit status 2
        sys.stderr.write(f"specdecode: error: {message}\n")
        sys.exit(2)


def _parser_adders() -> list:
    """Each command's add_parser, in --help's order (loadtest's reads serve's options: it comes after)."""
    from ..apply.cli import add_parser as apply
    from ..bench.cli import add_parser as bench
    from ..loadtest.cli import add_parser as loadtest
    from .certify import add_parser as certify
    from .generate import add_parser as generate
    from .index import add_parser as index
    from .serve import add_parser as serve

    return [generate, apply, bench, serve, index, certify, loadtest]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdecode", description="Lossless speculative decoding for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in _parser_adders():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    restart_if_command()  # the `specdecode` command runs itself again with huge pages, before torch loads
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except SpecDecodeError as e:
        sys.stderr.write(f"specdecode: error: {' '.join(str(e).split())}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("specdecode: interrupted\n")
        return 130
