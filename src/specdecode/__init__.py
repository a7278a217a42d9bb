"""specdecode: lossless speculative decoding for Hugging Face causal language models.

The package's names load on first use (PEP 562), so `import specdecode` loads neither torch nor a model and
has no effect on the process; the `specdecode` command's restart for huge pages is the CLI's (cli.main)."""
from __future__ import annotations

import importlib
import sys
import types

from .lazy import lazy_names

# each public name and the module that defines it (`verify`: the _Package property below)
_EXPORTS = {"Engine": ".engine", "METHODS": ".engine", "speculative_decode": ".loop", "SpecDecodeError": ".errors",
            "SamplingParams": ".sampling", "probs_from_logits": ".sampling", "Generation": ".stats", "Stats": ".stats"}

__all__ = ["Engine", "Generation", "Stats", "METHODS", "SpecDecodeError", "SamplingParams",
           "probs_from_logits", "speculative_decode", "verify"]
__version__ = "0.1.0"


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)


class _Package(types.ModuleType):
    """`specdecode.verify` is the function, as `from .verify import verify` made it: the import system sets the
    submodule of the same name on the package when it loads, and this keeps the name the function's."""

    @property
    def verify(self):
        return importlib.import_module(".verify", __name__).verify

    @verify.setter
    def verify(self, value) -> None:
        pass


sys.modules[__name__].__class__ = _Package
