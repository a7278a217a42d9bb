"""The llama.cpp backend: a GGUF model on llama.cpp's CPU kernels behind the LM interface (lm.py: LlamaLM), passes
run on the process's one compute thread (../compute.py), continuous batching on one shared context (batching.py, cut
into calls by split.py), the draft's requantization (quantize.py) and the check of the build's AMX kernels
(amx.py). llama-cpp-python's bindings are imported on first use only (lm._lib). Code outside backends/ reaches
these names through specdecode.backends, never this package."""

from .amx import NO_AMX_FLAGS
from .batching import LlamaSlot, Lockstep, SharedContext, node_ids
from .lm import MAX_CTX, MAX_SEQ, N_BATCH, LlamaLM, available, default_threads
from .split import plan_split, time_mixing

__all__ = [
    "LlamaLM",
    "LlamaSlot",
    "Lockstep",
    "MAX_CTX",
    "MAX_SEQ",
    "N_BATCH",
    "NO_AMX_FLAGS",
    "SharedContext",
    "available",
    "default_threads",
    "node_ids",
    "plan_split",
    "time_mixing",
]
