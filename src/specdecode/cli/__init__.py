"""The command line: `specdecode COMMAND ...` and `python -m specdecode ...`.

dispatch.py builds the parser from each command's `add_parser` and runs the command; args.py holds the argument
groups that generate, serve and bench share; load.py loads the models those arguments name; generate.py,
serve.py, certify.py and index.py are commands. apply/, bench/ and loadtest/ keep their own command's parser
(their cli.py), registered through dispatch.py. Nothing below the command line imports this package, and nothing
here imports torch at module level."""

from .dispatch import build_parser, main

__all__ = ["build_parser", "main"]
