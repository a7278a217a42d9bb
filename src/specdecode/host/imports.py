"""The command's heavy imports with the cyclic garbage collector paused, then frozen."""

from __future__ import annotations

import gc
import importlib
import sys

MODEL_IMPORTS = ("torch", "transformers")  # what every command that loads a model imports (GGUF ones too)


def import_frozen(names: tuple[str, ...]) -> None:
    """Import `names` with the cyclic collector paused, then freeze every object alive (gc.freeze): torch's and
    transformers' imports build millions of objects that live as long as the process, and the full collections that
    walked them while they loaded were an eighth of a command's start (docs: design/architecture.md, "Start-up").
    Frozen, later collections skip them. For the command only: it owns its process, a library user's does not.
    Nothing happens where they are loaded already (main() called again, or inside a program that imported them)."""
    if all(name in sys.modules for name in names):
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        for name in names:
            importlib.import_module(name)
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
