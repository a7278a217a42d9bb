"""Drafters propose tokens; they never touch the target.

`propose(ids, gamma, params, generator)` returns a Draft: up to gamma tokens that continue `ids`,
with their draft probabilities q (or q=None for a deterministic drafter: one-hot q).
`prefill(ids)` lets a drafter with a cache read the prompt up front (timed as prefill, not drafting);
`rollback(length)` tells the drafter that only ids[:length] of what it has seen still stands.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .kv import CachedLM
from .sampling import SamplingParams, probs_from_logits, sample


@dataclass
class Draft:
    tokens: list[int]  # [gamma'] proposed ids, a chain (gamma' <= gamma; empty = nothing to propose)
    q: torch.Tensor | None  # [gamma', V] draft probabilities; None = deterministic drafter (one-hot q)


class DraftModel:
    """A small causal LM that shares the target's tokenizer: gamma forwards, one token each."""

    def __init__(self, model, vocab_size: int):
        self.lm = CachedLM(model)
        self.vocab_size = vocab_size  # the target's V: q must live on the same support as p

    def reset(self) -> None:
        self.lm.reset()

    def prefill(self, ids: list[int]) -> None:
        self.lm.forward(ids, last_only=True)

    def propose(self, ids: list[int], gamma: int, params: SamplingParams, generator=None) -> Draft:
        lm = self.lm
        # Cache invariant: lm.ids is a prefix of ids (rollback keeps it so); feed what it lacks.
        pending = ids[len(lm):]
        tokens, qs = [], []
        for _ in range(gamma):
            logits = lm.forward(pending, last_only=True)[-1]  # [V_draft]
            logits = _fit_vocab(logits, self.vocab_size)
            if params.greedy:
                token = int(logits.argmax())
            else:
                q = probs_from_logits(logits, params)
                token = int(sample(q, generator))
                qs.append(q)
            tokens.append(token)
            pending = [token]
        return Draft(tokens, torch.stack(qs) if qs else None)

    def rollback(self, length: int) -> None:
        self.lm.rollback(min(length, len(self.lm)))


class PromptLookup:
    """Prompt lookup decoding: find the latest earlier occurrence of the last n tokens (n from
    max_ngram down to min_ngram) and propose the tokens that followed it. No model, no cost."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

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
                    return Draft(tokens, None)
        return Draft([], None)

    def rollback(self, length: int) -> None:
        pass


def _fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Align draft logits with the target's vocabulary size (padded embedding rows may differ)."""
    V = logits.shape[-1]
    if V > vocab_size:
        return logits[..., :vocab_size]
    if V < vocab_size:
        pad = logits.new_full((*logits.shape[:-1], vocab_size - V), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
    return logits
