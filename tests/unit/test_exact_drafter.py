"""Exact mode's drafter wrapper (exactness.ExactDrafter), without models: the loop's step has no exact-mode branch, so
what keeps a draft within the exact pass sizes is checked here."""

from specdecode.drafters import Draft, Drafter
from specdecode.exactness import ExactDrafter, ExactLimits


class Recorder:
    """A drafter that proposes a fixed tree (root -> 0 -> 1 -> 2, and 3 beside 0) and records what it is asked."""

    def __init__(self):
        self.calls = []

    def reset(self):
        self.calls.append("reset")

    def prefill(self, ids):
        self.calls.append(("prefill", len(ids)))

    def propose(self, ids, gamma, params, generator=None):
        self.calls.append(("propose", gamma))
        return Draft([10, 11, 12, 13], None, parents=[-1, 0, 1, -1])

    def commit(self, length, path, bonus):
        self.calls.append(("commit", length, tuple(path), bonus))


class Target:
    def __init__(self, cells):
        self.used = cells

    def cells(self):
        return self.used


def test_the_exact_drafter_keeps_each_step_within_the_exact_pass_sizes():
    inner, target = Recorder(), Target(10)
    drafter = ExactDrafter(inner, ExactLimits(max_pass=3, trees=False, max_context=100), target)
    assert isinstance(drafter, Drafter)
    drafter.reset()
    drafter.prefill([1, 2, 3])
    draft = drafter.propose([1, 2, 3], 5, None)  # depth clamped to 2 guesses, the tree cut to its chain
    assert draft.tokens == [10, 11] and draft.parents is None
    drafter.commit(3, [0], 7)
    target.used = 99  # past the context the sizes were measured up to: a plain step, the drafter not asked or told
    assert drafter.propose([1, 2, 3, 10, 7], 5, None).tokens == []
    drafter.commit(5, [], 8)
    assert inner.calls == ["reset", ("prefill", 3), ("propose", 2), ("commit", 3, (0,), 7)]


def test_the_exact_drafter_keeps_trees_where_they_are_exact():
    inner = Recorder()
    drafter = ExactDrafter(inner, ExactLimits(max_pass=4, trees=True, max_context=100), Target(10))
    draft = drafter.propose([1], 1, None)  # the loop's depth (1) asked for; the draft cut to 3 nodes, a tree
    assert inner.calls == [("propose", 1)] and draft.tokens == [10, 11, 12] and draft.parents == [-1, 0, 1]
