"""What a generation learns online about its guesses: the probability that a guessed token is
accepted given its parent was, as a function of what the drafter knew when it guessed.

For a draft-model node that is the draft's confidence (EAGLE-2 observes that the two track each
other; here the map is measured, starting from the prior "confidence = acceptance"), kept apart for
the draft's first choice and for the others. For a lookup guess it is a bin of (source, matched
n-gram length, observed frequency, depth). Every verdict teaches the bins of all nodes that were
tried, pruned ones included.
"""

from __future__ import annotations

from ..drafters.lookup import SOURCES, Guess

# Lookup bins. A 4-gram match whose continuations all agree is a far better guess than a 1-gram match
# seen once; the edges split the values seen on code and chat into bins that fill within a few steps.
LOOKUP_NGRAM_EDGES = (2, 3, 5)  # n-gram length: 1 | 2 | 3-4 | 5+ (5+ only from a datastore)
LOOKUP_FREQ_EDGES = (0.3, 0.6, 0.9)  # observed frequency count(node)/count(parent)
LOOKUP_DEPTH_EDGES = (2, 4)  # depth: 1 | 2-3 | 4+
_SHAPE = (len(SOURCES), len(LOOKUP_NGRAM_EDGES) + 1, len(LOOKUP_FREQ_EDGES) + 1, len(LOOKUP_DEPTH_EDGES) + 1)
LOOKUP_BINS = _SHAPE[0] * _SHAPE[1] * _SHAPE[2] * _SHAPE[3]
PRIOR_WEIGHT = 4.0  # a bin's prior counts as 4 verdicts: a few of its own outweigh it
RHO_PRIOR = 0.6  # P(some child accepted | an expanded node accepted) before any verdict (EAGLE-2's trees on code)
RHO_DECAY = 0.95  # its moving average spans about the last 20 expansions


class Calibration:
    """P(node accepted | parent accepted) as a function of a feature in [0, 1] (the draft's
    confidence), in bins, each with a Beta prior centred on prior(feature)."""

    def __init__(self, bins: int = 10, weight: float = PRIOR_WEIGHT, prior=lambda x: x):
        self.bins, self.weight, self.prior = bins, weight, prior
        self.hits = [0.0] * bins
        self.tries = [0.0] * bins

    def _bin(self, x: float) -> int:
        return min(int(x * self.bins), self.bins - 1)

    def __call__(self, x: float) -> float:
        b = self._bin(x)
        centre = self.prior((b + 0.5) / self.bins)
        return (self.hits[b] + self.weight * centre) / (self.tries[b] + self.weight)

    def update(self, x: float, accepted: bool) -> None:
        b = self._bin(x)
        self.hits[b] += accepted
        self.tries[b] += 1


def _bucket(x: float, edges) -> int:
    return sum(x >= e for e in edges)


def lookup_feature(g: Guess) -> float:
    """The calibration feature in [0, 1) of a lookup guess (the centre of its bin)."""
    b = (
        SOURCES.index(g.source),
        _bucket(g.ngram, LOOKUP_NGRAM_EDGES),
        _bucket(g.freq, LOOKUP_FREQ_EDGES),
        _bucket(g.depth, LOOKUP_DEPTH_EDGES),
    )
    index = ((b[0] * _SHAPE[1] + b[1]) * _SHAPE[2] + b[2]) * _SHAPE[3] + b[3]
    return (index + 0.5) / LOOKUP_BINS


def lookup_prior(x: float) -> float:
    """Before any verdict: a guess is worth about half its observed frequency, less for short matches
    (a 1-gram match rarely continues as it did); each bin learns after a few verdicts of its own."""
    index = int(x * LOOKUP_BINS)
    freq = index // _SHAPE[3] % _SHAPE[2]
    ngram = index // (_SHAPE[3] * _SHAPE[2]) % _SHAPE[1]
    return (0.15, 0.45, 0.75, 0.95)[freq] * (0.4, 0.5, 0.6, 0.7)[ngram]


class Acceptance:
    """The calibrations of one generation."""

    def __init__(self):
        self.draft = (Calibration(), Calibration())  # the draft's first choice, and its others
        self.lookup = Calibration(bins=LOOKUP_BINS, prior=lookup_prior)
        self.rho = RHO_PRIOR  # the gain of expanding a node: P(some child accepted | it was)
        self.first = [0.0, 0.0]  # the draft's first choices tried: decayed (accepted, tried), for a chain's alpha

    def value(self, node) -> float:
        """P(node accepted | parent accepted), for a tree.Node."""
        if node.conf is None:  # a followed copy's guess carries its own value (drafters/copy.py)
            return node.value if node.lookup is None else self.lookup(node.lookup)
        return self.draft[min(node.rank, 1)](node.conf)

    def learn(self, nodes: list, emitted: list[int]) -> None:
        """Every grown node whose parent's path was emitted was (or, pruned, would have been) tried:
        it counts as accepted when its token is the one emitted at its depth. Pruned nodes so teach
        the calibration for free, and the value of a rarely kept kind of node still gets learned."""
        hit = [False] * len(nodes)
        for i, nd in enumerate(nodes):  # parents come before children
            if nd.depth > len(emitted) or (nd.parent >= 0 and not hit[nd.parent]):
                continue
            hit[i] = nd.token == emitted[nd.depth - 1]
            if nd.conf is None:
                if nd.lookup is not None:  # (a followed copy learns from the output itself)
                    self.lookup.update(nd.lookup, hit[i])
            else:
                self.draft[min(nd.rank, 1)].update(nd.conf, hit[i])
                if nd.rank == 0:
                    self.first = [RHO_DECAY * self.first[0] + hit[i], RHO_DECAY * self.first[1] + 1]
        for i, nd in enumerate(nodes):  # did expanding an accepted node pay?
            if nd.cache is not None and hit[i]:
                self.rho = RHO_DECAY * self.rho + (1 - RHO_DECAY) * any(
                    hit[j] for j, c in enumerate(nodes) if c.parent == i
                )
