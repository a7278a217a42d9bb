"""The LM protocol: a causal LM with its KV cache, the one seam between the engine and a backend.

Everything that differs between backends is a member of the LM (declared here, with its default):
whether it can run token trees (`tree_error`), how many tree nodes its cache holds, whether its
output layer can be truncated (FR-Spec), the GGUF file it runs, its threads, its rounding. Code
outside `backends/` asks the LM, never which backend it is (`backend` is a label for reports).
A backend subclasses LM (explicitly, so that it inherits the defaults); loading.py loads it, and its
`as_lm` wraps a Hugging Face model.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from ..errors import SpecDecodeError


def common_start(held: list[int], ids: list[int], most: int) -> int:
    """How many of the first `most` tokens of `ids` `held` starts with (most: at most either's length)."""
    n = 0
    while n < most and held[n] == ids[n]:
        n += 1
    return n


def no_autograd(fn):
    """fn under torch.inference_mode(), entered only where it is off: the loop turns it on once per step, and each
    entry costs about 3 us of Python where a step makes several passes and rollbacks."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run


@runtime_checkable
class LM(Protocol):
    """A causal LM with its KV cache: the one seam between the engine (drafters, trees, cost model,
    bench, server) and a backend. CachedLM (torch) and LlamaLM (llama.cpp) implement it.

    Cache index space: entry i of the cache holds the keys/values of ids[i]; entries [0, trunk) are
    committed text at positions 0.., the rest a tree of drafted tokens, each with its parent entry."""

    backend: str  # "torch" | "llama.cpp": a label for reports and logs; nothing branches on it
    name: str
    vocab_size: int  # rows of the output layer: logits are [n, vocab_size]
    max_length: int  # positions the model can attend over
    eos_token_ids: set[int]
    # tokens that end a generation by the backend's own list, beyond eos_token_ids (llama.cpp: every token
    # llama_vocab_is_eog names, such as <|im_end|> or <|eom_id|>); the loop stops on both. Default: none more
    eog_ids: frozenset[int] = frozenset()
    ids: list[int]  # the token in each cache entry
    device: torch.device  # where its passes run (llama.cpp: the CPU)
    dtype: object  # a torch.dtype on torch; the GGUF file type's name ("Q8_0", "F32", ...) on llama.cpp
    threads: int  # CPU threads its passes use
    gguf_path: Path | None = None  # the GGUF file it runs (llama.cpp, for the bench's llama.cpp peers); None: none
    max_tree_nodes: int | None = None  # the most tree nodes its cache holds at once (llama.cpp: 255); None: no cap
    quant_info: dict | None = None  # the draft requantization chosen at loading (llama.cpp); None: the file as is
    hf_model = None  # the Hugging Face model behind it (torch), for transformers' own generation; None: none
    exact: bool = False  # loaded so that passes can be bit-exact (exactness.py measures which); llama.cpp: exact=True
    # why several generations cannot share its passes (continuous batching, slots()); None: they can (llama.cpp)
    batch_error: str | None = (
        "continuous batching (several generations in one pass) needs the llama.cpp backend; "
        "this backend runs one generation at a time"
    )

    def forward(self, new_ids: list[int], last_only: bool = False, parents: list[int] | None = None) -> torch.Tensor:
        """Append new_ids to the cache in one pass; float32 logits [n, V] (the last row only with
        last_only). parents[i]: the cache entry new_ids[i] follows (a tree); None: a chain."""

    def rollback(self, length: int, path: list[int] = ()) -> None:
        """Keep entries [0, length) and then the entries `path` (an accepted branch), in that order."""

    def reset(self) -> None:
        """Empty the cache."""

    def __len__(self) -> int:
        """Entries in the cache."""

    parked = 0  # cells held outside the text (llama.cpp exact mode: rejected tree nodes below an accepted one)
    prompt_read = 0  # the text's first tokens, read as a prompt (prefill): a cache rebuilt in exact mode reads them so

    def mark_prompt(self) -> None:
        """The text cached now was read as a prompt (in passes of the backend's batch); a method, so that wrappers
        that pass every other attribute on (certify.RowRecorder) set it on the LM itself."""
        self.prompt_read = len(self)

    # exact mode: every pass padded to at least this many rows, so a 1-token step runs the kernels a k-token pass
    # runs (exactness.py measures whether that makes k-token passes exact, and whether it costs too much); the
    # padding's cells are dropped before forward returns. can_pad: the backend honours it (torch)
    pad_rows, can_pad = 1, False

    def cells(self) -> int:
        """Cache cells in use, parked ones included: kernels may pick their path by the cache's size."""
        return len(self) + self.parked

    def describe(self) -> str:
        """What pass costs depend on (the key of the measured cost model)."""

    def synchronize(self) -> None:
        """Wait for queued device work (for timing)."""

    def _branch(self, length: int, path) -> tuple[int, list[int]]:
        """rollback's arguments checked, for a backend whose cache is a trunk (entries [0, trunk), committed
        text) plus tree entries with `_parent(i)`: (length, path) with a kept prefix that runs into the tree
        moved into the path. ValueError unless `path` is a branch hanging off entry length-1."""
        path = list(path)
        if not 0 <= length <= len(self.ids):
            raise ValueError(f"cannot roll back to {length}: {len(self.ids)} tokens cached")
        if length > self.trunk and path:  # the kept prefix runs into the tree: it is part of the branch
            path, length = list(range(self.trunk, length)) + path, self.trunk
        prev = length - 1
        for i in path:
            if not (length <= i < len(self.ids)) or self._parent(i) != prev:
                raise ValueError(f"cache entries {path} are not a branch hanging off entry {length - 1}")
            prev = i
        return length, path

    owner: str | None = None  # whose text the cache holds, for keep_prefix (None: nobody's, never reused)

    def keep_prefix(self, ids: list[int], scope: str | None) -> int:
        """Keep the longest cached stretch of committed text that starts `ids` (at most all of ids but its last
        token, which a pass must read for its logits) and drop the rest; the kept length (0: the cache emptied).
        A prompt that starts as the last one did (a chat's system prompt, a conversation's earlier turns) then
        reads only what is new."""
        n = self.cached_prefix(ids, scope)
        if n:
            self.rollback(n)
        else:
            self.reset()
        return n

    def cached_prefix(self, ids: list[int], scope: str | None) -> int:
        """How much of `ids` keep_prefix would keep (the cache left as it is): nothing unless the text was left by
        a generation of the same scope (None: never; an API key's hash in the server: one client's text never
        speeds up another's)."""
        if scope is None or self.owner != scope:
            return 0
        return common_start(self.ids, ids, min(getattr(self, "trunk", 0), len(ids) - 1))

    def release(self) -> None:
        """The generation that began with keep_prefix has ended (a batch slot may then share its text with the other
        slots; the default does nothing)."""

    # asked (a callable: True = stop) between the passes of a re-read of the cache where one is made anew
    # (LlamaLM.reserve); the running generation's interrupt (prefill.interruptible), None between generations
    interrupt = None

    def reserve(self, n: int) -> None:
        """Make room for n tokens of text before a generation starts (a backend whose cache is sized up
        front grows it here; the default does nothing)."""

    def reading_prompt(self):
        """A context manager held while a prompt is read (a batch slot then tells the others it is not decoding,
        so they do not wait for it; the default does nothing)."""
        return contextlib.nullcontext()

    def tree_error(self) -> str | None:
        """Why this model cannot run token trees (a pass with a tree of parents); None (the default) if it can."""
        return None

    def output_truncation_error(self) -> str | None:
        """Why this model's output layer cannot be truncated (FR-Spec's draft vocabulary); None if it can.
        The default: it cannot (a backend whose graph computes the whole output layer)."""
        return (
            "a truncated draft vocabulary needs the torch backend: llama.cpp computes the whole output "
            "layer in its graph"
        )

    def truncate_output(self, keep: torch.Tensor) -> None:
        """Keep only these rows (sorted token ids) of the output layer: logits are then [n, len(keep)].
        The default: SpecDecodeError with output_truncation_error()."""
        raise SpecDecodeError(self.output_truncation_error())

    def tolerances(self) -> dict:
        """The size of kernel rounding differences here, for `specdecode certify`: "rollback" (a logit after a
        rollback against the same text written to the same cells, place_chain) and "tie" (the greedy near-tie
        bound). The default: an fp32 model's, 1e-3 both."""
        return {"rollback": 1e-3, "tie": 1e-3}

    def place_chain(self, ids: list[int], slots: list[int], size: int, filler: int) -> None:
        """Append the causal chain `ids` in one pass of `size` tokens, ids[k] in the pass's slot slots[k] (ascending)
        and `filler` tokens that no chain token sees in the others; only the chain stays cached. The chain's entries
        then sit in the cells where a tree pass of `size` nodes leaves a kept branch at those slots (certify's
        reference for a rollback). The default, for a cache that rollback compacts: the chain, then the fillers,
        cropped."""
        start = len(self)
        self.forward(list(ids) + [filler] * (size - len(ids)))
        self.rollback(start + len(ids))
