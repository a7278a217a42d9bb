"""Backends: a causal LM with its KV cache behind one interface (base.LM), on torch (torch_lm.CachedLM)
or llama.cpp (the llamacpp subpackage: llamacpp.LlamaLM), and the loading of model files (loading.py). Outside
this package code asks an LM what it can do (its members), never which backend it is. A new backend: a module
(or a subpackage) here with a class that subclasses LM, and its case in loading.resolve_backend / load_lm.

The names load on first use (PEP 562): the command line's parsers read the choices (choices.py) without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_names
from .choices import BACKENDS, DRAFT_QUANT_CHOICES

if TYPE_CHECKING:
    from .base import LM

_EXPORTS = {
    "LM": ".base",
    "CachedLM": ".torch_lm",
    **dict.fromkeys(
        (
            "BUILTIN",
            "DEFAULT_DRAFT",
            "DEFAULT_TARGET",
            "ChunkedGGUF",
            "as_lm",
            "assemble",
            "cache_dir",
            "check_draft_vocab",
            "converted",
            "gguf_tokenizer",
            "load_draft_lm",
            "load_lm",
            "load_model",
            "load_tokenizer",
            "resolve_backend",
            "torch_copy_bytes",
            "torch_threads_for",
        ),
        ".loading",
    ),
    # the llama.cpp subpackage's names that code outside backends/ uses (continuous batching's slots, the
    # llama-server build): importing this package loads none of llama.cpp's modules or bindings
    **dict.fromkeys(("LlamaLM", "Lockstep", "NO_AMX_FLAGS", "node_ids", "time_mixing"), ".llamacpp"),
}

__all__ = [
    "LM",
    "CachedLM",
    "LlamaLM",
    "as_lm",
    "BACKENDS",
    "BUILTIN",
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "DRAFT_QUANT_CHOICES",
    "ChunkedGGUF",
    "assemble",
    "cache_dir",
    "check_draft_vocab",
    "converted",
    "gguf_tokenizer",
    "load_draft_lm",
    "load_lm",
    "load_model",
    "load_tokenizer",
    "resolve_backend",
    "torch_copy_bytes",
    "torch_threads_for",
    "slots",
    "Lockstep",
    "NO_AMX_FLAGS",
    "node_ids",
    "time_mixing",
]


def slots(lm: LM, n: int, cells: int, lockstep, cost=None) -> list[LM]:
    """n LMs on lm's weights whose passes run together (continuous batching: llamacpp/batching.py), sharing a
    cache of `cells` entries; SpecDecodeError with lm.batch_error if its backend cannot."""
    from ..errors import SpecDecodeError

    if lm.batch_error is not None:
        raise SpecDecodeError(lm.batch_error)
    from .llamacpp.batching import SharedContext

    return SharedContext(lm, n, cells, lockstep, cost).slots


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
