"""specdecode: lossless speculative decoding for Hugging Face causal language models.

The package's names load on first use (PEP 562), so `import specdecode` loads neither torch nor a model and
has no effect on the process; the `specdecode` command's restart for huge pages is the CLI's (cli.main)."""

from __future__ import annotations

from .lazy import lazy_names

# each public name and the module that defines it; `verify` is the module of the acceptance rules (verify.verify,
# verify.verify_tree)
_EXPORTS = {
    "Engine": ".engine",
    "METHODS": ".engine",
    "speculative_decode": ".loop",
    "SpecDecodeError": ".errors",
    "SamplingParams": ".sampling",
    "probs_from_logits": ".sampling",
    "Generation": ".stats",
    "Stats": ".stats",
}

__all__ = [
    "Engine",
    "Generation",
    "Stats",
    "METHODS",
    "SpecDecodeError",
    "SamplingParams",
    "probs_from_logits",
    "speculative_decode",
    "verify",
]
__version__ = "0.1.0"


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, modules=("verify",))
