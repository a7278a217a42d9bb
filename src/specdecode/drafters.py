"""Drafters propose tokens; they never touch the target.

`propose(ids, gamma, params, generator)` returns a Draft that continues `ids`: a chain, or a token
tree (tree.py), with the distribution each token was drawn from (q=None: every token was chosen
deterministically, a one-hot q). `prefill(ids)` lets a drafter with a cache read the prompt up
front (timed as prefill, not drafting); `commit(length, path, bonus)` tells it that ids[:length],
the drafted nodes `path` (the accepted branch) and then the token `bonus` are what now stands.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from .errors import SpecDecodeError
from .kv import as_lm
from .sampling import SamplingParams, probs_from_logits, sample


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
    """What the loop (engine.speculative_decode) asks of a drafter: DraftModel, PromptLookup,
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


CATCHUP_APART = 16  # a root pass feeding more tokens than this reads them first in a pass of their own (timed)
DRAFT_WINDOW = 512  # tokens of context the draft model sees (see DraftModel.window; --draft-window)


class DraftModel:
    """A small causal LM that shares the target's tokenizer, with its own KV cache. As a drafter it
    proposes a chain of gamma tokens; tree.TreeDrafter grows trees with its root and expand passes.
    Cache invariant: the draft cache holds a prefix of the committed ids (all of them after a root pass)."""

    def __init__(self, model, vocab_size: int, window: int | None = DRAFT_WINDOW):
        self.lm = as_lm(model)  # an HF model (torch backend) or an LM such as llamacpp.LlamaLM
        self.vocab_size = vocab_size  # the target's V: q must live on the same support as p
        self.keep: torch.Tensor | None = None  # the token ids the output layer still has (None: all)
        # the draft sees only the last `window` tokens or so (None: all of them): ids[offset:] at positions
        # 0, 1, ... of its own cache. The draft never changes the output, so what it sees is free to choose;
        # on a long prompt it then reads a window instead of the whole prompt.
        self.window = window
        self.offset = 0

    def truncate(self, keep) -> None:
        """FR-Spec (Zhao et al. 2025): keep only these rows of the draft's output layer (the most
        frequent tokens), which is a large share of a small model's forward (151,936 x 896 of the
        0.5B's 494M weights). The draft then never proposes another token: q is zero there, which the
        verifier handles as any q (lossless); only the acceptance of rare tokens is lost."""
        model = getattr(self.lm, "model", None)
        if model is None or not hasattr(model, "get_output_embeddings"):
            raise SpecDecodeError("a truncated draft vocabulary needs the torch backend: llama.cpp computes the "
                                  "whole output layer in its graph")
        head = model.get_output_embeddings()
        if self.keep is not None:
            raise SpecDecodeError("the draft's output layer is truncated already")
        keep = torch.as_tensor(sorted({int(i) for i in keep}), dtype=torch.long)
        if not len(keep) or keep[0] < 0 or keep[-1] >= min(head.weight.shape[0], self.vocab_size):
            raise SpecDecodeError(f"draft vocabulary ids must lie in 0..{min(head.weight.shape[0], self.vocab_size) - 1}")
        w = head.weight
        new = torch.nn.Linear(w.shape[1], len(keep), bias=getattr(head, "bias", None) is not None,
                              device=w.device, dtype=w.dtype)
        with torch.no_grad():
            new.weight.copy_(w[keep.to(w.device)])
            if new.bias is not None:
                new.bias.copy_(head.bias[keep.to(w.device)])
        model.set_output_embeddings(new)  # the input embeddings stay whole: the draft reads every token
        self.keep = keep

    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary (-inf where the draft has no output row)."""
        if self.keep is None:
            return fit_vocab(logits, self.vocab_size)
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.keep] = logits
        return out

    def reset(self) -> None:
        self.lm.reset()
        self.offset = 0

    def _rebase(self, n: int) -> int:
        """The offset the draft's view starts at once n committed tokens stand: kept while the view is
        under 1.5 windows long (so the draft re-reads a window only every half window of text), else
        moved to n - window with the cache emptied."""
        w = self.view_window
        if w is None or n - self.offset <= w + w // 2:
            return self.offset
        return max(0, n - w)

    @property
    def view_window(self) -> int | None:
        """The window in force: at most half the draft's own context, so that a view of 1.5 windows and
        a draft's depth always fit in it (a short-context draft then never runs out of room)."""
        return None if self.window is None else max(1, min(self.window, self.lm.max_length // 2))

    def unread(self, n: int) -> int:
        """Tokens the draft must read (the last one included) before it guesses after n committed tokens:
        what the root pass feeds. Its cost is the catch-up a planner weighs before running the draft."""
        offset = self._rebase(n)
        return n - offset - (len(self.lm) if offset == self.offset else 0)

    def seen(self, n: int) -> int:
        """Tokens in the draft's view once it has caught up with n committed tokens (its context length)."""
        return n - self._rebase(n)

    def room(self, n: int) -> int:
        """How deep a draft may grow after n committed tokens without leaving the draft model's own
        context (positions 0 .. lm.max_length-1): the root pass reads up to view position n-1, and a node
        at depth d is fed (to get the logits of depth d+1) at view position n-1+d; the deepest nodes are
        never fed. 0 = the draft model can no longer draft: the target goes on without it."""
        return max(0, self.lm.max_length - self.seen(n) + 1)

    def prefill(self, ids: list[int]) -> None:
        if self.room(len(ids) + 1):  # a prompt longer than the draft's context: it never drafts
            self.offset = max(0, len(ids) - self.view_window) if self.window is not None else 0
            self.lm.reset()
            self.lm.forward(ids[self.offset:], last_only=True)

    def root(self, ids: list[int], read=None) -> tuple[torch.Tensor, int]:
        """Logits [V] of the token after ids, and how many tokens this pass fed. Cache invariant:
        lm.ids is a prefix of ids[offset:] (commit keeps it so); feed what it lacks. read(tokens): called
        first with the tokens to catch up on (all fed but the last), when there are more than a few, so
        that a caller can time that part apart."""
        offset = self._rebase(len(ids))
        if offset != self.offset:
            self.offset = offset
            self.lm.reset()
        pending = ids[self.offset + len(self.lm):]
        if read is not None and len(pending) > CATCHUP_APART:
            read(lambda: self.lm.forward(pending[:-1], last_only=True))
            return self._full(self.lm.forward(pending[-1:], last_only=True)[-1]), len(pending)
        return self._full(self.lm.forward(pending, last_only=True)[-1]), len(pending)

    def keep_branch(self, length: int, branch: list[int]) -> None:
        """ids[:length] and then the draft-cache entries `branch` (accepted tree nodes that went through a
        draft pass, hanging off the last cached entry) now stand."""
        n = length - self.offset
        self.lm.rollback(min(n, len(self.lm)), branch if len(self.lm) >= n else [])

    def expand(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """One pass over tree nodes (parents: draft-cache indices); logits [k, V] after each."""
        return self._full(self.lm.forward(tokens, parents=parents))

    def propose(self, ids: list[int], gamma: int, params: SamplingParams, generator=None) -> Draft:
        """A chain: gamma draft passes, each token drawn from the draft's q (greedy: its argmax)."""
        gamma = min(gamma, self.room(len(ids)))
        if gamma <= 0:  # the draft's context is full: a plain step
            return Draft([], None)
        logits, _ = self.root(ids)
        tokens, qs = [], []
        for i in range(gamma):
            q = probs_from_logits(logits, params)
            tokens.append(int(q.argmax()) if params.greedy else int(sample(q, generator)))
            qs.append(q)
            if i + 1 < gamma:  # the last token is fed with the next step's root pass, if accepted
                logits = self._full(self.lm.forward(tokens[-1:], last_only=True)[-1])
        q = None if params.greedy else torch.stack(qs)  # greedy: one-hot q
        return Draft(tokens, q, strategy="draft", sources=["draft"] * len(tokens))

    def commit(self, length: int, path: list[int], bonus: int) -> None:
        """Keep ids[:length] and the accepted draft tokens the cache holds (the next root feeds the rest)."""
        self.lm.rollback(min(length + len(path) - self.offset, len(self.lm)))


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
