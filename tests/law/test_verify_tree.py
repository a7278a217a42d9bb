"""Tests for specdecode.verify.verify_tree, the multi-branch speculative sampling rule for token trees.

Deterministic part: greedy targets (one-hot p) with deterministic drafts, where the rule must keep the
branch that agrees with the target's argmax at every step; a chain must match `verify`; bad inputs
raise ValueError.

Statistical part. The target is a synthetic Markov "language" over V = 5 tokens: P0 is the law of the
first token, P1[x] that of the second token after x, P2[y] that of the third after y (the bonus row
of a depth-2 tree). Each trial builds a depth-2 draft tree in one of several ways (siblings drawn
i.i.d. from the draft, drawn without replacement, chosen deterministically as the draft's top-k,
a drawn child followed by deterministic siblings, a chain), runs verify_tree once, and emits
path tokens + next_token (1 to 3 tokens). The test completes every sequence to 3 tokens by sampling
from the target itself, exactly as the following decoding steps would. A lossless rule makes the
triple follow P0(x) P1[x](y) P2[y](z); chi-square goodness of fit on the first-token marginal, the
pair (V*V cells) and the triple (V**3 cells), N = 10^5 trials per case, a case fails when a p-value
is <= 1e-6. Target and draft differ a lot and both have zero-probability tokens.

Negative controls: wrong multi-branch rules (siblings tried without the residual update; children
dropped after looking at their drawn value; top-k children verified with the q-ratio of the
distribution they were ranked by) run through the same harness and must be rejected.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import pytest
import torch

from helpers import TreeVerifier, _draw, gof_pvalue, no_residual_update  # the chain tests' chi-square and sampler
from specdecode.verify import verify, verify_tree

ALPHA = 1e-6  # a p-value at or below this is a failure
N = 100_000  # trials per statistical case (one verify_tree call each)
# Trials for each negative control. Their biases are large: the chi-square noncentrality of the pair
# test is about 0.05 (dropped_after_drawing) to 1.7 (top_k_with_sampling_q) per trial, i.e. >= 500
# here, where a p-value of 1e-6 needs a statistic of about 60. A control rejected with N_CONTROL trials
# is rejected a fortiori with the N trials of the positive cases; fewer trials keep the file fast.
N_CONTROL = 10_000


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def one_hot(tokens, V, dtype=torch.float32):
    return torch.nn.functional.one_hot(torch.as_tensor(tokens, dtype=torch.long), V).to(dtype)


# ============================================================================ deterministic tests


def greedy_reference(target: list[int], tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """Greedy tree acceptance: target[r] is the argmax of p row r (0 = root, i+1 = after node i).

    Follow, from the root, the child whose token is the target's argmax (siblings have distinct
    tokens here, so there is at most one); stop at a node with no such child.
    """
    path, row = [], 0
    while True:
        match = [i for i, par in enumerate(parents) if par + 1 == row and tokens[i] == target[row]]
        assert len(match) <= 1
        if not match:
            return path, target[row]
        path.append(match[0])
        row = match[0] + 1


def check_path(path, next_token, parents, V):
    assert isinstance(path, list) and all(isinstance(i, int) for i in path)
    assert isinstance(next_token, int) and 0 <= next_token < V
    prev = -1
    for i in path:  # a root-down branch: each node is a child of the one before
        assert parents[i] == prev
        prev = i


# A depth-3 tree (V = 6), node order mixing levels:
#   root -> 0 (tok 1), 1 (tok 3)
#   0 -> 2 (tok 2);  1 -> 3 (tok 4), 4 (tok 5);  4 -> 5 (tok 0), 6 (tok 2)
TREE_TOKENS = [1, 3, 2, 4, 5, 0, 2]
TREE_PARENTS = [-1, -1, 0, 1, 1, 4, 4]


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_later_sibling_right_at_every_level_then_bonus(with_q):
    # the first child is wrong at each level and a later sibling right; the whole depth is accepted
    V = 6
    # argmax of p row r: root, after node 0..6
    target = [3, 0, 5, 1, 1, 2, 0, 1]
    p = one_hot(target, V)
    q = one_hot(TREE_TOKENS, V) if with_q else None
    for seed in range(5):
        path, next_token = verify_tree(p, TREE_TOKENS, TREE_PARENTS, q, gen(seed))
        check_path(path, next_token, TREE_PARENTS, V)
        assert path == [1, 4, 6]
        assert next_token == 1  # the bonus: argmax of the row after node 6
        assert (path, next_token) == greedy_reference(target, TREE_TOKENS, TREE_PARENTS)


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_first_child_wrong_later_sibling_right(with_q):
    V = 6
    target = [3, 0, 4, 0, 2, 0, 0, 0]  # root -> 3 (node 1), after node 1 -> 4 (node 3, a leaf) -> 2
    p = one_hot(target, V)
    q = one_hot(TREE_TOKENS, V) if with_q else None
    for seed in range(5):
        path, next_token = verify_tree(p, TREE_TOKENS, TREE_PARENTS, q, gen(seed))
        assert (path, next_token) == ([1, 3], 2)


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_nothing_accepted(with_q):
    V = 6
    target = [5, 2, 2, 2, 2, 2, 2, 2]  # no root child has token 5
    p = one_hot(target, V)
    q = one_hot(TREE_TOKENS, V) if with_q else None
    for seed in range(5):
        assert verify_tree(p, TREE_TOKENS, TREE_PARENTS, q, gen(seed)) == ([], 5)


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_stops_inside_the_tree(with_q):
    V = 6
    target = [1, 3, 0, 0, 0, 0, 0, 0]  # node 0 right, its only child (tok 2) wrong -> 3 after node 0
    p = one_hot(target, V)
    q = one_hot(TREE_TOKENS, V) if with_q else None
    for seed in range(5):
        assert verify_tree(p, TREE_TOKENS, TREE_PARENTS, q, gen(seed)) == ([0], 3)


def test_greedy_whole_chain_accepted_gives_bonus():
    V = 7
    tokens = [4, 1, 6, 6]
    target = [4, 1, 6, 6, 2]
    p = one_hot(target, V)
    for q in (None, one_hot(tokens, V)):
        assert verify_tree(p, tokens, [-1, 0, 1, 2], q, gen(1)) == ([0, 1, 2, 3], 2)


def _random_tree(rng: random.Random, n: int, V: int) -> tuple[list[int], list[int]]:
    """Random tree of n nodes (parent before child), siblings with distinct tokens."""
    tokens, parents = [], []
    for i in range(n):
        for _ in range(100):
            parent = rng.randrange(-1, i)
            used = {tokens[j] for j in range(i) if parents[j] == parent}
            if len(used) < V:
                break
        tokens.append(rng.choice([t for t in range(V) if t not in used]))
        parents.append(parent)
    return tokens, parents


def test_greedy_random_trees_follow_the_argmax_branch():
    rng = random.Random(0)
    V = 6
    depths = set()
    for trial in range(300):
        n = rng.randrange(0, 12)
        tokens, parents = _random_tree(rng, n, V)
        # the target agrees with some child of the row with probability ~0.7
        target = []
        for row in range(n + 1):
            kids = [tokens[i] for i in range(n) if parents[i] + 1 == row]
            target.append(rng.choice(kids) if kids and rng.random() < 0.7 else rng.randrange(V))
        expected = greedy_reference(target, tokens, parents)
        depths.add(len(expected[0]))
        p = one_hot(target, V)
        for q in (None, one_hot(tokens, V).reshape(n, V)):
            path, next_token = verify_tree(p, tokens, parents, q, gen(trial))
            check_path(path, next_token, parents, V)
            assert (path, next_token) == expected, (tokens, parents, target)
    assert {0, 1, 2, 3} <= depths  # paths of several lengths occurred


def test_greedy_chain_matches_verify():
    g = gen(7)
    V = 6
    seen = set()
    for trial in range(200):
        gamma = int(torch.randint(0, 6, (), generator=g))
        target = torch.randint(0, V, (gamma + 1,), generator=g)
        draft = torch.where(
            torch.rand(gamma, generator=g) < 0.75, target[:gamma], torch.randint(0, V, (gamma,), generator=g)
        )
        p = one_hot(target, V)
        tokens = draft.tolist()
        parents = list(range(-1, gamma - 1))
        for q_tree, q_chain in ((None, None), (one_hot(draft, V), one_hot(draft, V)[None])):
            accepted, next_chain = verify(p[None], q_chain, draft[None], gen(trial))
            path, next_token = verify_tree(p, tokens, parents, q_tree, gen(trial))
            assert path == list(range(int(accepted))), (tokens, target.tolist())
            assert next_token == int(next_chain)
        seen.add((gamma, int(accepted)))
    assert len({a for _, a in seen}) >= 4


def test_empty_tree_samples_from_the_root_row():
    V = 5
    assert verify_tree(one_hot([3], V), [], [], None, gen()) == ([], 3)
    assert verify_tree(one_hot([1], V), [], [], torch.zeros(0, V), gen()) == ([], 1)
    p0 = torch.tensor([[0.5, 0.0, 0.5, 0.0, 0.0]])
    seen = {verify_tree(p0, [], [], None, gen(s))[1] for s in range(40)}
    assert seen == {0, 2}


def test_child_with_zero_target_probability_is_never_accepted():
    # root children: token 0 (p = 0, q large) then token 1 (residual [0, .4, .5, 0] / .9 vs q = .8)
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25] * 4, [0.0, 0.5, 0.5, 0.0]])
    q = torch.tensor([[0.9, 0.1, 0.0, 0.0], [0.0, 0.8, 0.2, 0.0]])
    outcomes = set()
    for seed in range(300):
        path, next_token = verify_tree(p, [0, 1], [-1, -1], q, gen(seed))
        assert 0 not in path and next_token != 0 and next_token != 3
        outcomes.add(tuple(path))
    assert outcomes == {(), (1,)}


def test_child_drawn_from_the_target_itself_is_always_accepted():
    p = torch.tensor([[0.2, 0.3, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0], [0.1, 0.2, 0.3, 0.4]])
    q = torch.tensor([[0.2, 0.3, 0.0, 0.5], [0.25] * 4])
    for seed in range(50):
        path, next_token = verify_tree(p, [3, 1], [-1, -1], q, gen(seed))  # q row 0 == p row 0
        assert path == [0] and next_token == 2


def test_reproducible_and_inputs_unchanged():
    g = gen(3)
    V, tokens, parents = 6, TREE_TOKENS, TREE_PARENTS
    p = torch.softmax(torch.randn(8, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(7, V, generator=g) * 2, -1)
    p0, q0, t0, par0 = p.clone(), q.clone(), list(tokens), list(parents)
    runs = [[verify_tree(p, tokens, parents, q, gen(s)) for s in range(30)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(set(map(str, runs[0]))) > 1
    verify_tree(p, tokens, parents, None, gen(0))
    assert torch.equal(p, p0) and torch.equal(q, q0) and tokens == t0 and parents == par0
    path, next_token = verify_tree(p, tokens, parents, q)  # no generator
    check_path(path, next_token, parents, V)


@pytest.mark.parametrize(
    "p_rows, n_tokens, parents, q_shape",
    [
        (4, 3, [-1, 0], None),  # parents shorter than tokens
        (4, 3, [-1, 0, 1, 2], None),  # parents longer
        (3, 3, [-1, 0, 1], None),  # p lacks the row after the last node
        (5, 3, [-1, 0, 1], None),  # p has a row too many
        (4, 3, [-1, 0, 1], (2, 5)),  # q rows != nodes
        (4, 3, [-1, 0, 1], (4, 5)),
        (4, 3, [-1, 0, 1], (3, 6)),  # q vocabulary != p vocabulary
        (4, 3, [-1, 0, 1], (3,)),
    ],
)
def test_shape_mismatch_raises_value_error(p_rows, n_tokens, parents, q_shape):
    p = torch.full((p_rows, 5), 0.2)
    q = None if q_shape is None else torch.full(q_shape, 0.2)
    with pytest.raises(ValueError, match="shape mismatch"):
        verify_tree(p, [0] * n_tokens, parents, q, gen())


@pytest.mark.parametrize("parents", [[0, -1, 0], [-1, 1, 0], [-1, 0, 3], [-1, -2, 0], [-1, 0, 2]])
def test_parent_not_before_child_raises_value_error(parents):
    p = torch.full((4, 5), 0.2)
    for q in (None, torch.full((3, 5), 0.2)):
        with pytest.raises(ValueError, match="parent"):
            verify_tree(p, [0, 1, 2], parents, q, gen())


# ============================================================================ statistics


def test_gof_pvalue_basics():
    probs = np.array([0.5, 0.25, 0.25, 0.0])
    assert gof_pvalue(np.array([500, 250, 250, 0]), probs) == pytest.approx(1.0)
    assert gof_pvalue(np.array([500, 250, 249, 1]), probs) == 0.0  # a zero-probability cell hit
    assert gof_pvalue(np.array([700, 150, 150, 0]), probs) < ALPHA
    assert gof_pvalue(np.array([99_999, 1]), np.array([1 - 1e-6, 1e-6])) > ALPHA


# ---------------------------------------------------------------------------- the synthetic language

V = 5
_f64 = dict(dtype=torch.float64)
# target: first token, second token given the first (row x), third given the second (row y)
P0 = torch.tensor([0.30, 0.25, 0.25, 0.20, 0.00], **_f64)
P1 = torch.tensor(
    [
        [0.05, 0.40, 0.00, 0.25, 0.30],
        [0.50, 0.00, 0.20, 0.10, 0.20],
        [0.10, 0.20, 0.30, 0.00, 0.40],
        [0.00, 0.35, 0.15, 0.30, 0.20],
        [0.20, 0.20, 0.20, 0.20, 0.20],  # after token 4, which the target never emits first
    ],
    **_f64,
)
P2 = torch.tensor(
    [
        [0.00, 0.30, 0.30, 0.20, 0.20],
        [0.60, 0.10, 0.10, 0.10, 0.10],
        [0.10, 0.10, 0.00, 0.40, 0.40],
        [0.25, 0.25, 0.25, 0.25, 0.00],
        [0.10, 0.20, 0.30, 0.40, 0.00],
    ],
    **_f64,
)
# draft: never proposes token 1 first (the target's second most likely), often proposes token 4,
# which the target forbids; no ties, so top-k is unambiguous
Q0 = torch.tensor([0.10, 0.00, 0.40, 0.30, 0.20], **_f64)
Q1 = torch.tensor(
    [
        [0.30, 0.10, 0.20, 0.40, 0.00],
        [0.10, 0.30, 0.00, 0.40, 0.20],
        [0.40, 0.00, 0.10, 0.30, 0.20],
        [0.20, 0.30, 0.26, 0.00, 0.24],
        [0.10, 0.20, 0.30, 0.40, 0.00],
    ],
    **_f64,
)
JOINT2 = P0[:, None] * P1  # [x, y]
JOINT3 = JOINT2[:, :, None] * P2[None]  # [x, y, z]


@pytest.mark.stat
def test_draw_matches_probabilities():
    x = _draw(Q0.expand(N, V), gen(3))
    assert gof_pvalue(np.bincount(x.numpy(), minlength=V), Q0.numpy()) > ALPHA
    assert not (x == 1).any()


# ---------------------------------------------------------------------------- sibling schemes
# A scheme picks k siblings for every trial at once: base [n, V] (the draft's distribution at that
# place in each trial's tree) -> tokens [n, k] and q rows [n, k, V] (the law each token was drawn
# from; one-hot for a deterministic choice).


def iid(base, k, g):
    tokens = torch.stack([_draw(base, g) for _ in range(k)], 1)
    return tokens, base[:, None].expand(-1, k, -1)


def without_replacement(base, k, g):
    left = base.clone()
    tokens, qs = [], []
    for _ in range(k):
        dist = left / left.sum(-1, keepdim=True)
        t = _draw(dist, g)
        tokens.append(t)
        qs.append(dist)
        left = left.scatter(-1, t[:, None], 0.0)
    return torch.stack(tokens, 1), torch.stack(qs, 1)


def top_k(base, k, g):
    tokens = base.topk(k, -1).indices
    return tokens, one_hot(tokens, V, torch.float64)


def top_k_with_sampling_q(base, k, g):
    """Negative control (iii): top-k children, but q rows = the distribution they were ranked by."""
    return base.topk(k, -1).indices, base[:, None].expand(-1, k, -1)


def drawn_then_top(base, k, g):
    """The first sibling drawn from base; the rest the most likely base tokens not yet taken."""
    first = _draw(base, g)
    tokens, qs = [first], [base]
    taken = one_hot(first, V, torch.bool)
    for _ in range(k - 1):
        t = base.masked_fill(taken, -1.0).argmax(-1)
        tokens.append(t)
        qs.append(one_hot(t, V, torch.float64))
        taken = taken | one_hot(t, V, torch.bool)
    return torch.stack(tokens, 1), torch.stack(qs, 1)


# ---------------------------------------------------------------------------- trees and the harness


@dataclass
class Trees:
    """n trials' depth-2 trees of one shape: node i has token tokens[:, i] and q row q[:, i]."""

    tokens: torch.Tensor  # [n, m]
    parents: list[int]
    q: Optional[torch.Tensor]  # [n, m, V], or None: verify_tree's q=None (one-hot rule)
    keep: Optional[torch.Tensor] = None  # [n, m] bool: nodes actually in each trial's tree

    def p_rows(self) -> torch.Tensor:
        """[n, m+1, V]: row 0 = P0, after a depth-1 node with token x P1[x], after depth 2 P2[y]."""
        rows = [P0.expand(self.tokens.shape[0], V)]
        for i, parent in enumerate(self.parents):
            rows.append((P1 if parent == -1 else P2)[self.tokens[:, i]])
        return torch.stack(rows, 1)


def build(g, n, scheme: Callable, k1: int, k2: int, order: str = "bfs", pass_q: bool = True) -> Trees:
    """k1 children of the root drawn by scheme from Q0, each with k2 children from Q1[its token]."""
    t1, q1 = scheme(Q0.expand(n, V), k1, g)
    kids = [scheme(Q1[t1[:, i]], k2, g) for i in range(k1)]
    cols, qcols, parents = [], [], []
    if order == "bfs":
        for i in range(k1):
            cols.append(t1[:, i]), qcols.append(q1[:, i]), parents.append(-1)
        for i in range(k1):
            for j in range(k2):
                cols.append(kids[i][0][:, j]), qcols.append(kids[i][1][:, j]), parents.append(i)
    else:  # depth-first: each depth-1 node followed by its children
        for i in range(k1):
            node = len(cols)
            cols.append(t1[:, i]), qcols.append(q1[:, i]), parents.append(-1)
            for j in range(k2):
                cols.append(kids[i][0][:, j]), qcols.append(kids[i][1][:, j]), parents.append(node)
    q = torch.stack(qcols, 1).contiguous() if pass_q else None
    return Trees(torch.stack(cols, 1), parents, q)


@dataclass
class Outcome:
    seq: np.ndarray  # [n, 3] emitted tokens, completed from the target where fewer were emitted
    depth: np.ndarray  # [n] accepted path length


def run_trials(trees: Trees, verifier: TreeVerifier, g: torch.Generator) -> Outcome:
    n, m = trees.tokens.shape
    p_list = trees.p_rows().unbind(0)
    q_list = trees.q.unbind(0) if trees.q is not None else [None] * n
    tok_lists = trees.tokens.tolist()
    keep_lists = trees.keep.tolist() if trees.keep is not None else None
    parents = trees.parents
    seq = np.full((n, 3), -1, dtype=np.int64)
    depth = np.zeros(n, dtype=np.int64)
    for t in range(n):
        tokens, p, q, par = tok_lists[t], p_list[t], q_list[t], parents
        if keep_lists is not None:  # this trial's tree is the kept nodes only
            kept = [i for i in range(m) if keep_lists[t][i]]
            new = {old: j for j, old in enumerate(kept)}
            tokens = [tokens[i] for i in kept]
            par = [-1 if parents[i] == -1 else new[parents[i]] for i in kept]
            p = p[[0] + [i + 1 for i in kept]]
            q = q[kept] if q is not None else None
        path, next_token = verifier(p, tokens, par, q, g)
        prev = -1
        for k, i in enumerate(path):
            assert par[i] == prev, "path is not a root-down branch"
            seq[t, k] = tokens[i]
            prev = i
        seq[t, len(path)] = next_token
        depth[t] = len(path)
    assert depth.max() <= 2
    # complete to 3 tokens from the target, as the next decoding steps would
    s = torch.from_numpy(seq)
    need = s[:, 1] < 0
    s[need, 1] = _draw(P1[s[need, 0]], g)
    need = s[:, 2] < 0
    s[need, 2] = _draw(P2[s[need, 1]], g)
    return Outcome(s.numpy(), depth)


def lossless_pvalues(out: Outcome) -> dict[str, float]:
    x, y, z = out.seq.T
    return {
        "first": gof_pvalue(np.bincount(x, minlength=V), P0.numpy()),
        "pair": gof_pvalue(np.bincount(x * V + y, minlength=V * V), JOINT2.numpy()),
        "triple": gof_pvalue(np.bincount((x * V + y) * V + z, minlength=V**3), JOINT3.numpy()),
    }


def _fmt(d):
    return ", ".join(f"{k}={v:.3g}" for k, v in d.items())


# ---------------------------------------------------------------------------- the real verifier


@dataclass
class Mode:
    name: str
    make: Callable[[torch.Generator, int], Trees]


MODES = [
    # (a) siblings drawn i.i.d. (with replacement) from the draft
    Mode("iid", lambda g, n: build(g, n, iid, k1=2, k2=2)),
    # (b) siblings drawn without replacement, each from the draft renormalized without earlier siblings
    Mode("without_replacement", lambda g, n: build(g, n, without_replacement, k1=2, k2=3, order="dfs")),
    # (c) deterministic children: the draft's top-k, verified with q=None
    Mode("top_k", lambda g, n: build(g, n, top_k, k1=2, k2=2, pass_q=False)),
    # (d) one drawn child, then deterministic siblings with one-hot q rows
    Mode("drawn_then_top", lambda g, n: build(g, n, drawn_then_top, k1=2, k2=3, order="dfs")),
    # (e) a chain: one drawn child per level, which is the chain rule of `verify`
    Mode("chain", lambda g, n: build(g, n, iid, k1=1, k2=1)),
]


def _exact_depth_law(mode: str) -> Optional[np.ndarray]:
    """The law of the accepted path length, where it has a closed form."""
    if mode == "chain":  # P(accept x at depth 1) = min(P0, Q0)(x); then beta1(x) = sum min(P1[x], Q1[x])
        acc1 = torch.minimum(P0, Q0)
        beta1 = torch.minimum(P1, Q1).sum(-1)
    elif mode == "top_k":  # deterministic distinct children a, b: P(accept a) = P(a), P(accept b) = P(b)
        acc1 = torch.zeros(V, **_f64)
        top = Q0.topk(2).indices
        acc1[top] = P0[top]
        beta1 = torch.stack([P1[x, Q1[x].topk(2).indices].sum() for x in range(V)])
    else:
        return None
    d2 = float((acc1 * beta1).sum())
    d1 = float(acc1.sum()) - d2
    return np.array([1 - d1 - d2, d1, d2])


@pytest.mark.stat
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_tree_emits_target_distribution(mode):
    g = gen(1000 + MODES.index(mode))
    trees = mode.make(g, N)
    out = run_trials(trees, verify_tree, g)
    pvals = lossless_pvalues(out)
    freq = np.bincount(out.depth, minlength=3) / N
    # the tree matters: each path length is common (acceptance neither ~0 nor ~1)
    assert (freq > 0.1).all(), f"{mode.name}: path-length frequencies {freq}"
    law = _exact_depth_law(mode.name)
    if law is not None:
        pvals["depth"] = gof_pvalue(np.bincount(out.depth, minlength=3), law)
    bad = {k: v for k, v in pvals.items() if not v > ALPHA}
    assert not bad, f"{mode.name}: rejected ({_fmt(bad)}); all: {_fmt(pvals)}; depths {freq}"


def test_modes_cover_duplicates_and_forbidden_tokens():
    """The drawn trees really contain what makes the rule non-trivial."""
    g = gen(5)
    iid_trees = MODES[0].make(g, 2000)
    assert (iid_trees.tokens[:, 0] == iid_trees.tokens[:, 1]).any()  # duplicate siblings
    assert (iid_trees.tokens[:, :2] == 4).any()  # a child the target forbids
    wr = MODES[1].make(g, 2000)
    roots = wr.tokens[:, [i for i, par in enumerate(wr.parents) if par == -1]]
    assert (roots.sort(-1).values.diff(dim=-1) > 0).all()  # no duplicates without replacement
    assert not (roots == 1).any()  # the draft never proposes token 1 first
    assert (P0 == 0).any() and (Q0 == 0).any() and (P1 == 0).any() and (Q1 == 0).any()


# ============================================================================ negative controls


def dropped_after_drawing(g, n, threshold=0.15) -> Trees:
    """Negative control (ii): two root children drawn i.i.d. from Q0, each kept only if Q0(child) >=
    threshold (with its subtree); verified by the real rule with q rows = Q0 (the law they were drawn
    from). Whether a node exists depends on its own drawn value: the effective proposal law is not Q0."""
    trees = build(g, n, iid, k1=2, k2=2)
    keep = torch.ones_like(trees.tokens, dtype=torch.bool)
    for i, parent in enumerate(trees.parents):
        if parent == -1:
            keep[:, i] = Q0[trees.tokens[:, i]] >= threshold
    for i, parent in enumerate(trees.parents):
        if parent != -1:
            keep[:, i] = keep[:, parent]
    trees.keep = keep
    return trees


CONTROLS = {
    # (i) no residual update between siblings
    "no_update_residual_of_first": (lambda g, n: build(g, n, iid, 2, 2), no_residual_update("residual")),
    "no_update_sample_p": (lambda g, n: build(g, n, iid, 2, 2), no_residual_update("p")),
    # (ii) children dropped according to their own drawn value
    "dropped_after_drawing": (dropped_after_drawing, verify_tree),
    # (iii) top-k children verified with the q-ratio of the distribution they were ranked by
    "top_k_with_sampling_q": (lambda g, n: build(g, n, top_k_with_sampling_q, 2, 2), verify_tree),
}


def test_control_trees_differ_from_the_modes_only_where_intended():
    g = gen(8)
    t = dropped_after_drawing(g, 4000)
    roots = [i for i, par in enumerate(t.parents) if par == -1]
    assert (~t.keep[:, roots]).any() and t.keep[:, roots].all(-1).any()
    assert not (t.keep[:, roots] & (t.tokens[:, roots] == 0)).any()  # token 0 (Q0 = 0.1) always dropped
    tk = CONTROLS["top_k_with_sampling_q"][0](g, 10)
    assert torch.equal(tk.tokens, MODES[2].make(g, 10).tokens)  # the same trees as mode top_k


@pytest.mark.stat
@pytest.mark.parametrize("name", list(CONTROLS), ids=str)
def test_wrong_tree_rule_is_detected(name):
    make, verifier = CONTROLS[name]
    g = gen(2000 + list(CONTROLS).index(name))
    out = run_trials(make(g, N_CONTROL), verifier, g)
    # detected by the chi-square statistic itself, not by an impossible (zero-probability) sequence
    x, y, z = out.seq.T
    assert (JOINT3.numpy()[x, y, z] > 0).all()
    pvals = lossless_pvalues(out)
    assert min(pvals.values()) < ALPHA, f"{name} not detected: {_fmt(pvals)}"
