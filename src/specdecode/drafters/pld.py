"""Prompt lookup decoding: a chain continuing the latest earlier occurrence of the text's last tokens."""

from __future__ import annotations

import numpy as np

from ..sampling import SamplingParams
from .base import Draft


class PromptLookup:
    """Prompt lookup decoding: find the latest earlier occurrence of the last n tokens (n from
    max_ngram down to min_ngram) and propose the tokens that followed it. No model, no cost."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, prediction=None):
        """prediction: a copy.Alignment on the client's predicted output; while it is aligned its next gamma
        tokens are the chain."""
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.last_ngram = 0  # the length of the n-gram the last proposal matched (0: none)
        self.prediction = prediction

    def reset(self) -> None:
        pass

    def prefill(self, ids: list[int]) -> None:
        pass

    def propose(self, ids: list[int], gamma: int, params: SamplingParams = None, generator=None) -> Draft:
        copy = self.prediction.guess(ids, gamma) if self.prediction is not None else None
        if copy is not None:
            return Draft(copy.tokens, None, strategy="copy", sources=["prediction"] * len(copy.tokens))
        arr = np.asarray(ids, dtype=np.int64)
        L = len(arr)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            # match[s]: the n tokens from s (s = 0..L-1-n) equal the last n; one comparison per offset
            # (a sliding_window_view costs ~10x more on the short texts a step usually sees)
            match = arr[: L - n] == arr[L - n]
            for k in range(1, n):
                match &= arr[k : L - n + k] == arr[L - n + k]
            hits = np.flatnonzero(match)
            if len(hits):
                start = int(hits[-1]) + n
                tokens = arr[start : start + gamma].tolist()
                if tokens:
                    self.last_ngram = n
                    return Draft(tokens, None, strategy="lookup", sources=["context"] * len(tokens))
        self.last_ngram = 0
        return Draft([], None)

    def commit(self, length: int, path: list[int], bonus: int) -> None:
        pass
