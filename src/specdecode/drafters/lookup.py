"""Lookup drafting: guesses that cost (almost) nothing, read from text seen before.

Three sources, each an index that finds where the last tokens of the text occurred before and what
followed them there:
- "context": the current prompt and output (an n-gram table that grows with the text);
- "history": the engine's earlier outputs, without their prompts (the same n-gram table over
  all of them; bounded, the least recently used output evicted first);
- "datastore": a token datastore built once from the user's files (`specdecode index`): a suffix
  array (pydivsufsort's libdivsufsort) over a memory-mapped token file, searched in C.

Each source matches the longest suffix of the text it holds (up to its max n-gram length), and the
continuations of up to MAX_MATCHES of those occurrences (the latest ones for the context and the
history, evenly spaced ones for the datastore) form a tree whose nodes count how many continuations
pass through them: freq = count(node) / count(parent) is the observed P(token | path). The tree
planner (planning/tree.py) turns (source, n-gram length, freq, depth) into a calibrated acceptance value and
weighs the guesses against the draft model's with the measured pass costs. Every guess is one-hot
(deterministic), so any choice of guesses keeps the target's distribution (verify_tree's contract).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from .copy import Alignment, CopyGuess
from .datastore import Datastore
from .sources import History, NgramIndex

MAX_MATCHES = 16  # continuations read per source and step (SuffixDecoding and REST use a few dozen)
SOURCES = ("context", "history", "datastore", "prediction")


@dataclass
class Guess:
    """One node of a lookup tree (parents come before children)."""

    token: int
    parent: int  # index in the guess list, -1 = after the last committed token
    depth: int
    count: int  # continuations through this node
    freq: float  # count / count(parent): the observed P(token | path)
    ngram: int  # length of the matched suffix
    source: str
    refs: tuple = ()  # history: the stored outputs the continuations came from
    value: float | None = None  # a followed copy's own P(accepted | parent accepted) (copy.py); None: calibrated


def continuation_tree(conts: list[list[int]], refs: list, ngram: int, source: str, max_nodes: int) -> list[Guess]:
    """The trie of the continuations with its nodes counted; the max_nodes most likely nodes (by the
    product of freq along the path, best first) are kept, each after its parent."""
    children: dict[tuple, dict[int, list]] = {}  # path -> token -> [count, refs]
    for cont, ref in zip(conts, refs):
        path = ()
        for x in cont:
            node = children.setdefault(path, {}).setdefault(x, [0, set()])
            node[0] += 1
            if ref is not None:
                node[1].add(ref)
            path += (x,)
    guesses: list[Guess] = []
    heap: list = []
    order = 0  # ties: first seen first

    def push(path: tuple, parent: int, prob: float) -> None:
        nonlocal order
        kids = children.get(path, {})
        total = sum(c for c, _ in kids.values())
        for x, (c, r) in kids.items():
            heapq.heappush(heap, (-prob * c / total, order, path + (x,), parent, c, c / total, tuple(sorted(r))))
            order += 1

    push((), -1, 1.0)
    while heap and len(guesses) < max_nodes:
        neg, _, path, parent, c, freq, r = heapq.heappop(heap)
        guesses.append(Guess(path[-1], parent, len(path), c, freq, ngram, source, r))
        push(path, len(guesses) - 1, -neg)
    return guesses


class Lookup:
    """The lookup drafter: one tree of guesses per step from every source it has. Sources: the
    context (always), the engine's History and a Datastore (when given). copies: the texts the output is
    followed through (copy.Alignment: a prediction, the prompt), best first."""

    def __init__(
        self,
        history: History | None = None,
        datastore: Datastore | None = None,
        max_matches: int = MAX_MATCHES,
        copies: list[Alignment] | None = None,
    ):
        self.history, self.datastore = history, datastore
        self.max_matches = max_matches
        self.context = NgramIndex()
        self.copies = list(copies or [])

    def _indexes(self) -> list:
        """(name, index) of every source it has, in SOURCES order: each answers lookup(text, depth, limit)."""
        return [
            (name, index)
            for name, index in zip(SOURCES, (self.context, self.history, self.datastore))
            if index is not None
        ]

    @property
    def sources(self) -> list[str]:
        names = [name for name, _ in self._indexes()]
        return names + [c.source for c in self.copies if c.source not in names]

    def copy_chain(self, ids: list[int], depth: int) -> CopyGuess | None:
        """The followed copy worth the most expected tokens over `depth` (None: no copy is aligned)."""
        guesses = [g for g in (c.guess(ids, depth) for c in self.copies) if g is not None]
        return max(guesses, key=lambda g: sum(g.values), default=None)

    def copy_guesses(self, ids: list[int], depth: int) -> list[Guess]:
        """A prediction's chain as lookup guesses, for a tree (the prompt's own copy the context's n-grams find)."""
        out: list[Guess] = []
        for c in self.copies:
            g = c.guess(ids, depth) if c.source == "prediction" else None
            prev, base = 1.0, len(out)
            for j, (x, v) in enumerate(zip(g.tokens, g.values) if g is not None else ()):
                out.append(
                    Guess(
                        x,
                        base + j - 1 if j else -1,
                        j + 1,
                        1,
                        1.0,
                        g.run,
                        c.source,
                        value=v / prev if prev > 0 else 0.0,
                    )
                )
                prev = v
        return out

    def prefill(self, ids: list[int]) -> None:
        self.context = NgramIndex()
        self.context.extend(ids)

    def reset(self) -> None:
        self.context = NgramIndex()

    def tree(self, ids: list[int], max_depth: int, max_nodes: int) -> list[Guess]:
        """Guesses from every source (each its own tree; context first), parents before children."""
        if len(self.context) < len(ids):
            self.context.extend(ids[len(self.context) :])
        out: list[Guess] = self.copy_guesses(ids, max_depth) if max_depth > 0 else []
        for source, index in self._indexes() if max_depth > 0 else ():
            n, conts, refs = index.lookup(ids, max_depth, self.max_matches)
            base = len(out)
            for g in continuation_tree(conts, refs, n, source, max_nodes) if n else ():
                g.parent = g.parent + base if g.parent >= 0 else -1
                out.append(g)
        return out

    def accepted(self, guesses: list[Guess]) -> None:
        """These guesses were accepted: their stored outputs were just used (LRU)."""
        if self.history is not None:
            self.history.touch({r for g in guesses if g.source == "history" for r in g.refs})
