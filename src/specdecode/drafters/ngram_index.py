"""Where each n-gram of a token sequence occurs, in two flat arrays: a fixed 12 bytes per position of the sequence.

A dict of tuples to lists of positions costs about 200 bytes a token (a tuple, a list and a dict slot per n-gram),
so a long prediction or prompt followed by several requests at once would hold megabytes each; here the n-grams are
packed into one 64-bit key each and sorted with their positions, and a look-up is a binary search.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from typing import Sequence

TOKEN_BITS = 21  # bits of a token id in a packed key: ids below 2**21 (larger than any tokenizer's vocabulary)
POS_BITS = 32  # bits of a position while sorting (positions are stored as C ints)


class NgramIndex:
    """get(ngram): the positions just after each occurrence of that n-gram in `tokens`, ascending (an empty array
    where it does not occur). Memory: 8 bytes of key and 4 of position per n-gram of the sequence, fixed once built;
    while it is built, a sorted list of Python integers (about 50 bytes a token) lives for a moment."""

    def __init__(self, tokens: Sequence[int], n: int):
        if n * TOKEN_BITS > 63:
            raise ValueError(f"n-grams of {n} tokens do not pack into 63 bits")
        if len(tokens) >= 1 << (POS_BITS - 1):
            raise ValueError("the sequence is too long to index")
        self.n = n
        top = max(tokens, default=0)
        if top >= 1 << TOKEN_BITS or min(tokens, default=0) < 0:
            raise ValueError(f"token ids must be in [0, 2**{TOKEN_BITS}), got {top}")
        ends = range(n, len(tokens) + 1)
        packed = sorted(self._pack(tokens[end - n : end]) << POS_BITS | end for end in ends)
        self._keys, self._ends = array("q", bytes(8 * len(packed))), array("i", bytes(4 * len(packed)))  # exact sizes
        low = (1 << POS_BITS) - 1
        for i, x in enumerate(packed):
            self._keys[i], self._ends[i] = x >> POS_BITS, x & low

    @staticmethod
    def _pack(ngram: Sequence[int]) -> int:
        key = 0
        for token in ngram:
            key = key << TOKEN_BITS | token
        return key

    def get(self, ngram: Sequence[int]) -> array:
        if len(ngram) != self.n or any(not 0 <= t < 1 << TOKEN_BITS for t in ngram):
            return array("i")
        key = self._pack(ngram)
        return self._ends[bisect_left(self._keys, key) : bisect_right(self._keys, key)]

    def __len__(self) -> int:
        return len(self._ends)
