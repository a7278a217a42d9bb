"""Drafters propose tokens; they never touch the target.

`propose(ids, gamma, params, generator)` returns a Draft that continues `ids`: a chain, or a token
tree (planning/tree.py), with the distribution each token was drawn from (q=None: every token was chosen
deterministically, a one-hot q). `prefill(ids)` lets a drafter with a cache read the prompt up
front (timed as prefill, not drafting); `commit(length, path, bonus)` tells it that ids[:length],
the drafted nodes `path` (the accepted branch) and then the token `bonus` are what now stands.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch

from ..sampling import SamplingParams


@dataclass
class Draft:
    tokens: list[int]  # [n] proposed ids (empty = nothing to propose)
    q: torch.Tensor | None  # [n, V] the distribution each token was drawn from; None = one-hot (deterministic)
    parents: list[int] | None = None  # [n] parent node of each token (-1 = the last committed token); None = chain
    expected: float | None = None  # the drafter's estimate of tokens this pass will emit, bonus included
    modelled_s: float | None = None  # the cost model's seconds for this step (drafting + the target pass)
    strategy: str | None = None  # what this step ran: plain, lookup, draft (a chain), tree
    sources: list[str] | None = None  # [n] where each token came from: draft, context, history, datastore
    plain_s: float | None = None  # the cost model's seconds of one plain step at this context
    catchup_s: float = 0.0  # wall seconds the drafter spent reading text it had not seen (in the step's time)

    @property
    def tree_parents(self) -> list[int]:
        return list(range(-1, len(self.tokens) - 1)) if self.parents is None else self.parents

    def prefix(self, n: int, chain: bool = False) -> "Draft":
        """The first n nodes (a tree's nodes come parents first, so they are a tree again); with chain,
        only the chain that runs from the root through nodes 0, 1, 2, ... Node indices are unchanged."""
        if chain and self.parents is not None:
            m = 0
            while m < len(self.parents) and self.parents[m] == m - 1:
                m += 1
            n = min(n, m)
        if n >= len(self.tokens) and (self.parents is None or not chain):
            return self
        parents = None if self.parents is None or chain else self.parents[:n]
        return replace(
            self,
            tokens=self.tokens[:n],
            q=None if self.q is None else self.q[:n],
            parents=parents,
            sources=None if self.sources is None else self.sources[:n],
        )

    @property
    def depth(self) -> int:
        if self.parents is None:
            return len(self.tokens)
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return max(depth, default=0)


@runtime_checkable
class Drafter(Protocol):
    """What the loop (loop.speculative_decode) asks of a drafter: DraftModel, PromptLookup,
    tree.TreeDrafter. Cache convention: the target's cache holds every committed id but the last,
    which goes into the next target pass as the root of the draft."""

    def reset(self) -> None:
        """Forget the previous generation."""

    def prefill(self, ids: list[int]) -> None:
        """Read the prompt up front (timed as prefill, not drafting)."""

    def propose(self, ids: list[int], gamma: int, params: SamplingParams, generator=None) -> "Draft":
        """Guesses that continue ids, at most gamma deep (the loop never drafts what it cannot emit)."""

    def commit(self, length: int, path: list[int], bonus: int) -> None:
        """ids[:length], then the drafted nodes `path` (the accepted branch), then `bonus` now stand."""


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Align draft logits with the target's vocabulary size (padded embedding rows may differ)."""
    V = logits.shape[-1]
    if V > vocab_size:
        return logits[..., :vocab_size]
    if V < vocab_size:
        pad = logits.new_full((*logits.shape[:-1], vocab_size - V), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
    return logits
