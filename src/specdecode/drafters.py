"""Drafters propose tokens; they never touch the target.

`propose(ids, gamma, params, generator)` returns a Draft that continues `ids`: a chain, or a token
tree (tree.py), with the distribution each token was drawn from (q=None: every token was chosen
deterministically, a one-hot q). `prefill(ids)` lets a drafter with a cache read the prompt up
front (timed as prefill, not drafting); `commit(length, path, bonus)` tells it that ids[:length],
the drafted nodes `path` (the accepted branch) and then the token `bonus` are what now stands.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .kv import as_lm
from .sampling import SamplingParams


@dataclass
class Draft:
    tokens: list[int]  # [n] proposed ids (empty = nothing to propose)
    q: torch.Tensor | None  # [n, V] the distribution each token was drawn from; None = one-hot (deterministic)
    parents: list[int] | None = None  # [n] parent node of each token (-1 = the last committed token); None = chain
    expected: float | None = None  # the drafter's estimate of tokens this pass will emit, bonus included
    modelled_s: float | None = None  # the cost model's seconds for this step (drafting + the target pass)
    strategy: str | None = None  # what this step ran: plain, lookup, draft (a chain), tree
    sources: list[str] | None = None  # [n] where each token came from: draft, context, history, datastore

    @property
    def tree_parents(self) -> list[int]:
        return list(range(-1, len(self.tokens) - 1)) if self.parents is None else self.parents

    @property
    def depth(self) -> int:
        if self.parents is None:
            return len(self.tokens)
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return max(depth, default=0)


class DraftModel:
    """A small causal LM that shares the target's tokenizer, with its own KV cache. Drafting grows a
    tree of guesses (tree.py); a chain of gamma tokens is the tree with one child per node."""

    def __init__(self, model, vocab_size: int):
        self.lm = as_lm(model)  # an HF model (torch backend) or an LM such as llamacpp.LlamaLM
        self.vocab_size = vocab_size  # the target's V: q must live on the same support as p
        self._chain = None

    def reset(self) -> None:
        self.lm.reset()

    def room(self, n: int) -> int:
        """How deep a draft may grow after n committed tokens without leaving the draft model's own
        context (positions 0 .. lm.max_length-1): the root pass reads up to position n-1, and a node at
        depth d is fed (to get the logits of depth d+1) at position n-1+d; the deepest nodes are never
        fed. 0 = the draft model can no longer draft: the target goes on without it."""
        return max(0, self.lm.max_length - n + 1)

    def prefill(self, ids: list[int]) -> None:
        if self.room(len(ids) + 1):  # a prompt longer than the draft's context: it never drafts
            self.lm.forward(ids, last_only=True)

    def root(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        """Logits [V] of the token after ids, and how many tokens this pass fed. Cache invariant:
        lm.ids is a prefix of ids (commit keeps it so); feed what it lacks."""
        pending = ids[len(self.lm):]
        return fit_vocab(self.lm.forward(pending, last_only=True)[-1], self.vocab_size), len(pending)

    def expand(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """One pass over tree nodes (parents: draft-cache indices); logits [k, V] after each."""
        return fit_vocab(self.lm.forward(tokens, parents=parents), self.vocab_size)

    def propose(self, ids: list[int], gamma: int, params: SamplingParams, generator=None) -> Draft:
        from .tree import TreeDrafter  # the chain is the one-child tree
        gamma = min(gamma, self.room(len(ids)))
        if gamma <= 0:  # the draft's context is full: a plain step
            self._chain = None
            return Draft([], None)
        self._chain = TreeDrafter(self, pld=False, width=1, depth=gamma, adaptive=False)
        return self._chain.propose(ids, gamma, params, generator)

    def commit(self, length: int, path: list[int], bonus: int) -> None:
        if self._chain is not None:
            self._chain.commit(length, path, bonus)


class PromptLookup:
    """Prompt lookup decoding: find the latest earlier occurrence of the last n tokens (n from
    max_ngram down to min_ngram) and propose the tokens that followed it. No model, no cost."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.last_ngram = 0  # the length of the n-gram the last proposal matched (0: none)

    def reset(self) -> None:
        pass

    def prefill(self, ids: list[int]) -> None:
        pass

    def propose(self, ids: list[int], gamma: int, params: SamplingParams = None, generator=None) -> Draft:
        arr = np.asarray(ids, dtype=np.int64)
        L = len(arr)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)  # starts 0..L-1-n
            hits = np.flatnonzero((windows == arr[L - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                tokens = arr[start:start + gamma].tolist()
                if tokens:
                    self.last_ngram = n
                    return Draft(tokens, None, strategy="lookup", sources=["context"] * len(tokens))
        self.last_ngram = 0
        return Draft([], None)

    def commit(self, length: int, path: list[int], bonus: int) -> None:
        pass


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Align draft logits with the target's vocabulary size (padded embedding rows may differ)."""
    V = logits.shape[-1]
    if V > vocab_size:
        return logits[..., :vocab_size]
    if V < vocab_size:
        pad = logits.new_full((*logits.shape[:-1], vocab_size - V), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
    return logits
