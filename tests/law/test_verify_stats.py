"""Statistical tests: speculative sampling through verify() emits exactly the target distribution.

Set-up. The target p_t and draft q_t are position-dependent but context-independent: the token at
absolute output position t has target distribution P[t] whatever came before, so the target's own
joint law over positions 0..T-1 is the product P[0] x P[1] x ... . A vectorized decoding loop runs
N independent sequences: at each step every unfinished row drafts gamma tokens x_i ~ Q[s+i]
(s = tokens emitted so far) -- or takes the fixed tokens D[s+i] for a deterministic drafter
(q=None) -- calls the verifier once for all rows, and appends draft[:accepted] + [next_token].
Because steps end at random places, the second step starts at different absolute positions in
different rows; this is what makes the joint test meaningful (a step that emits one token is
followed by a fresh step for position 1).

Checks (chi-square goodness of fit, zero-expected cells must have zero counts, cells with small
expected counts merged; a case fails when any p-value <= 1e-6):
  * marginal of every output position t < T = gamma + 1 against P[t] (exercises the bonus token),
  * joint of every adjacent pair (t, t+1) against P[t] x P[t+1],
  * the full joint of all T positions when it has few enough cells,
  * separately, the first step's acceptance length against prod(beta_i) (beta_i = sum min(p_i, q_i)).
The harness takes any callable with verify()'s signature; deliberately wrong verifiers defined
below must fail the same statistic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import pytest
import torch

from helpers import _draw, gof_pvalue
from specdecode.sampling import SamplingParams, probs_from_logits, sample
from specdecode.verify import verify

N = 100_000  # sequences, all in the first verifier call
ALPHA = 1e-6  # a p-value at or below this is a failure
MAX_FULL_JOINT_CELLS = 4096

Verifier = Callable[..., tuple]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small, many tensors (conftest.py)


# ============================================================================ statistics


# ============================================================================ cases


@dataclass
class Case:
    name: str
    gamma: int
    P: torch.Tensor  # [L, V] target distribution at absolute output position t
    Q: Optional[torch.Tensor]  # [L, V] draft distribution, or None: deterministic drafter
    D: Optional[torch.Tensor] = None  # [L] deterministic draft tokens (when Q is None)

    @property
    def T(self) -> int:  # output positions checked; a full first step can emit gamma + 1
        return self.gamma + 1

    @property
    def V(self) -> int:
        return self.P.shape[-1]


def _L(gamma):  # positions a step may touch: starts at s <= T-1 and reads s..s+gamma
    return 2 * gamma + 1


def _rand_dist(g, L, V, zero_frac=0.0, sharp=2.0):
    """Random distributions [L, V] (skewed), each token zeroed with prob zero_frac (>= 1 kept)."""
    w = torch.rand(L, V, generator=g, dtype=torch.float64) ** sharp + 1e-3
    if zero_frac > 0:
        zero = torch.rand(L, V, generator=g) < zero_frac
        keep = torch.randint(0, V, (L,), generator=g)
        zero[torch.arange(L), keep] = False
        w = w.masked_fill(zero, 0.0)
    return (w / w.sum(-1, keepdim=True)).float()


def _one_hot(tokens, V):
    return torch.nn.functional.one_hot(tokens, V).float()


def _dims(g):
    V = int(torch.randint(4, 9, (1,), generator=g))
    gamma = int(torch.randint(1, 5, (1,), generator=g))
    return V, gamma


def make_random(seed, zero_frac=0.3):
    g = torch.Generator().manual_seed(seed)
    V, gamma = _dims(g)
    L = _L(gamma)
    return Case(f"random-s{seed}-z{zero_frac}", gamma, _rand_dist(g, L, V, zero_frac), _rand_dist(g, L, V, zero_frac))


def make_disjoint(seed):
    g = torch.Generator().manual_seed(seed)
    V, gamma = _dims(g)
    L = _L(gamma)
    in_p = torch.zeros(L, V, dtype=torch.bool)
    for t in range(L):  # a random non-empty proper subset per position
        perm = torch.randperm(V, generator=g)
        k = int(torch.randint(1, V, (1,), generator=g))
        in_p[t, perm[:k]] = True
    w = torch.rand(2, L, V, generator=g) + 0.05
    P = w[0].masked_fill(~in_p, 0)
    Q = w[1].masked_fill(in_p, 0)
    return Case(f"disjoint-s{seed}", gamma, P / P.sum(-1, keepdim=True), Q / Q.sum(-1, keepdim=True))


def make_equal(seed):
    g = torch.Generator().manual_seed(seed)
    V, gamma = _dims(g)
    P = _rand_dist(g, _L(gamma), V, zero_frac=0.3)
    return Case(f"p_eq_q-s{seed}", gamma, P, P.clone())


def make_onehot_p(seed, q_on_target=0.0):
    g = torch.Generator().manual_seed(seed)
    V, gamma = _dims(g)
    L = _L(gamma)
    target = torch.randint(0, V, (L,), generator=g)
    P = _one_hot(target, V)
    Q = _rand_dist(g, L, V, zero_frac=0.3)
    if q_on_target:
        Q = (1 - q_on_target) * Q + q_on_target * P
    return Case(f"onehot_p-s{seed}-q{q_on_target}", gamma, P, Q)


def make_deterministic_drafter(seed, onehot_p=False):
    g = torch.Generator().manual_seed(seed)
    V, gamma = _dims(g)
    L = _L(gamma)
    P = _one_hot(torch.randint(0, V, (L,), generator=g), V) if onehot_p else _rand_dist(g, L, V, 0.3)
    # the drafter guesses the target's mode at about half the positions, an arbitrary token elsewhere
    # (possibly one the target forbids)
    guess = torch.rand(L, generator=g) < 0.5
    D = torch.where(guess, P.argmax(-1), torch.randint(0, V, (L,), generator=g))
    return Case(f"q_none-s{seed}-onehot{int(onehot_p)}", gamma, P, None, D)


def make_from_logits(seed, params: SamplingParams, noise=1.0):
    """Target and draft logits correlated (draft = target + noise); the same SamplingParams on both."""
    g = torch.Generator().manual_seed(seed)
    V, gamma = _dims(g)
    L = _L(gamma)
    logits_p = torch.randn(L, V, generator=g) * 2
    logits_q = logits_p + noise * torch.randn(L, V, generator=g)
    P = probs_from_logits(logits_p, params)
    Q = probs_from_logits(logits_q, params)
    label = f"T{params.temperature}-k{params.top_k}-p{params.top_p}"
    return Case(f"logits-s{seed}-{label}", gamma, P, Q)


CASES = [
    *(make_random(s) for s in range(4)),
    make_random(10, zero_frac=0.0),
    make_random(11, zero_frac=0.6),
    *(make_disjoint(s) for s in (20, 21)),
    *(make_equal(s) for s in (30, 31)),
    make_onehot_p(40),
    make_onehot_p(41, q_on_target=0.8),
    make_deterministic_drafter(50),
    make_deterministic_drafter(51),
    make_deterministic_drafter(52, onehot_p=True),
    make_from_logits(60, SamplingParams(temperature=1.0)),
    make_from_logits(61, SamplingParams(temperature=0.7, top_k=3)),
    make_from_logits(62, SamplingParams(temperature=1.5, top_p=0.8)),
    make_from_logits(63, SamplingParams(temperature=1.0, top_k=5, top_p=0.9)),
    make_from_logits(64, SamplingParams(temperature=2.0, top_k=2), noise=2.0),
    make_from_logits(65, SamplingParams(temperature=0.0)),  # greedy target and greedy draft
]


# ============================================================================ simulation


def simulate(verifier: Verifier, case: Case, n: int = N, seed: int = 0):
    """Decode n independent sequences of T tokens; returns (tokens [n, T], first-step accepted [n])."""
    g = torch.Generator().manual_seed(seed)
    gamma, T, V = case.gamma, case.T, case.V
    out = torch.full((n, T), -1, dtype=torch.long)
    pos = torch.zeros(n, dtype=torch.long)
    offs = torch.arange(gamma + 1)
    first_accepted = None
    for _ in range(T):  # every step emits at least one token
        active = (pos < T).nonzero().squeeze(1)
        if active.numel() == 0:
            break
        m = active.numel()
        s = pos[active]
        idx = s[:, None] + offs  # [m, gamma+1] absolute positions
        p = case.P[idx]
        if case.Q is None:
            q = None
            draft = case.D[idx[:, :gamma]]
        else:
            q = case.Q[idx[:, :gamma]]
            draft = _draw(q, g)
        accepted, next_token = verifier(p, q, draft, g)
        assert accepted.shape == (m,) and next_token.shape == (m,)
        assert ((accepted >= 0) & (accepted <= gamma)).all()
        assert ((next_token >= 0) & (next_token < V)).all()
        if first_accepted is None:
            first_accepted = accepted.clone()
        tokens = torch.cat([draft, torch.zeros(m, 1, dtype=torch.long)], 1)
        tokens[torch.arange(m), accepted] = next_token
        count = accepted + 1
        for j in range(gamma + 1):
            sel = (j < count) & (s + j < T)
            out[active[sel], s[sel] + j] = tokens[sel, j]
        pos[active] = s + count
    assert (out >= 0).all(), "decoding loop did not fill every position"
    return out, first_accepted


def lossless_pvalues(case: Case, out: torch.Tensor) -> dict[str, float]:
    """p-values of the emitted tokens against the target's product law."""
    V, T = case.V, case.T
    P = case.P.double().numpy()
    o = out.numpy()
    res = {}
    for t in range(T):
        res[f"marginal[{t}]"] = gof_pvalue(np.bincount(o[:, t], minlength=V), P[t])
    for t in range(T - 1):
        cells = np.bincount(o[:, t] * V + o[:, t + 1], minlength=V * V)
        res[f"joint[{t},{t + 1}]"] = gof_pvalue(cells, np.outer(P[t], P[t + 1]).ravel())
    if T > 2 and V**T <= MAX_FULL_JOINT_CELLS:
        code = np.zeros(len(o), dtype=np.int64)
        prob = np.ones(1)
        for t in range(T):
            code = code * V + o[:, t]
            prob = np.outer(prob, P[t]).ravel()
        res[f"joint[0..{T - 1}]"] = gof_pvalue(np.bincount(code, minlength=V**T), prob)
    return res


def acceptance_probs(case: Case) -> np.ndarray:
    """Law of the first step's acceptance count: P(acc >= k) = prod_{i<k} beta_i."""
    P = case.P.double()
    if case.Q is None:
        beta = P[torch.arange(case.gamma), case.D[: case.gamma]]
    else:
        beta = torch.minimum(P[: case.gamma], case.Q[: case.gamma].double()).sum(-1)
    beta = beta.clamp(max=1.0).numpy()
    surv = np.concatenate([[1.0], np.cumprod(beta)])  # P(acc >= k), k = 0..gamma
    law = surv.copy()
    law[:-1] -= surv[1:]
    return np.clip(law, 0.0, None)


def _fmt(pvals):
    return ", ".join(f"{k}={v:.3g}" for k, v in pvals.items())


# ============================================================================ the real verifier


def _run(verifier, case, seed=1234):
    out, first_acc = simulate(verifier, case, seed=seed)
    return out, first_acc, lossless_pvalues(case, out)


@pytest.mark.stat
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_verify_emits_target_distribution(case):
    out, first_acc, pvals = _run(verify, case)
    # zero-probability target tokens are never emitted at any position
    for t in range(case.T):
        forbidden = (case.P[t] == 0).nonzero().squeeze(1)
        assert not torch.isin(out[:, t], forbidden).any(), f"position {t} emitted a zero-probability token"
    bad = {k: v for k, v in pvals.items() if not v > ALPHA}
    assert not bad, f"{case.name}: rejected ({_fmt(bad)}); all: {_fmt(pvals)}"


@pytest.mark.stat
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_first_step_acceptance_length_law(case):
    """Acceptance is as high as the rule allows: P(accept x_i) = sum_x min(p_i, q_i)."""
    g = torch.Generator().manual_seed(99)
    gamma, V = case.gamma, case.V
    p = case.P[: gamma + 1].expand(N, gamma + 1, V)
    if case.Q is None:
        q, draft = None, case.D[:gamma].expand(N, gamma)
    else:
        q = case.Q[:gamma].expand(N, gamma, V)
        draft = _draw(case.Q[:gamma].expand(N, gamma, V), g)
    accepted, _ = verify(p, q, draft, g)
    pv = gof_pvalue(np.bincount(accepted.numpy(), minlength=gamma + 1), acceptance_probs(case))
    assert pv > ALPHA, f"{case.name}: acceptance-length law rejected, p={pv:.3g}"


def test_cases_cover_the_requested_situations():
    names = " ".join(c.name for c in CASES)
    for word in ("random", "disjoint", "p_eq_q", "onehot_p", "q_none", "logits", "T0.0"):
        assert word in names
    assert len({c.V for c in CASES}) >= 3
    assert len({c.gamma for c in CASES}) >= 3
    assert any((c.P == 0).any() for c in CASES) and any(c.Q is not None and (c.Q == 0).any() for c in CASES)


# ============================================================================ wrong verifiers


def make_rule(*, always_accept=False, prefix=True, residual="clamp", bonus_from_last_draft=False):
    """A from-scratch verifier with switchable mistakes; the defaults give the correct rule."""

    def rule(p, q, draft_tokens, generator=None):
        B, g1, V = p.shape
        gamma = g1 - 1
        rows = torch.arange(B)
        qf = _one_hot(draft_tokens, V) if q is None else q
        px = p[:, :gamma].gather(-1, draft_tokens[..., None])[..., 0]
        qx = qf.gather(-1, draft_tokens[..., None])[..., 0]
        u = torch.rand(B, gamma, generator=generator)
        ok = torch.ones_like(px, dtype=torch.bool) if always_accept else (u * qx < px)
        accepted = ok.long().cumprod(-1).sum(-1) if prefix else ok.long().sum(-1)
        # the first rejected position (a no-prefix rule mislabels which one it is)
        first_rej = (ok.long().cumprod(-1).sum(-1)).clamp(max=gamma - 1)
        at = accepted.clamp(max=gamma - 1) if prefix else first_rej
        p_rej, q_rej = p[rows, at], qf[rows, at]
        if residual == "clamp":
            res = (p_rej - q_rej).clamp(min=0)
        elif residual == "p":
            res = p_rej.clone()
        elif residual == "abs":
            res = (p_rej - q_rej).abs()
        else:
            raise AssertionError(residual)
        res = torch.where(res.sum(-1, keepdim=True) > 0, res, p_rej)
        bonus_pos = gamma - 1 if bonus_from_last_draft else gamma
        full = accepted == gamma
        dist = torch.where(full[:, None], p[:, bonus_pos], res)
        return accepted, sample(dist, generator)

    return rule


WRONG_VERIFIERS = {
    # keeps every draft token: emits q instead of p
    "always_accept": make_rule(always_accept=True),
    # on rejection resamples from p instead of norm(max(0, p - q)): over-weights tokens q already covers
    "rejection_samples_p": make_rule(residual="p"),
    # residual without the clamp: norm(|p - q|) puts mass where q > p (even where p = 0)
    "residual_abs": make_rule(residual="abs"),
    # counts all accepted positions instead of the accepted prefix: keeps tokens after a rejection
    "no_prefix": make_rule(prefix=False),
    # bonus token drawn from the last draft position's target instead of p[gamma]
    "bonus_off_by_one": make_rule(bonus_from_last_draft=True),
}


def _negative_case():
    """Hand-made: V=4, gamma=2, each position a rotation of the same (p, q) pair.

    p = [.6, .3, .1, 0], q = [.1, .2, .3, .4] (rotated by t): sum min = .4; correct residual
    [.5, .1, 0, 0]/.6. First-token laws: resample-from-p gives [.46, .38, .16, 0]; abs residual and
    always-accept give the forbidden token 3 positive mass; consecutive positions differ (bonus test).
    """
    base_p = torch.tensor([0.6, 0.3, 0.1, 0.0])
    base_q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    gamma = 2
    L = _L(gamma)
    P = torch.stack([base_p.roll(t) for t in range(L)])
    Q = torch.stack([base_q.roll(t) for t in range(L)])
    return Case("hand-rotated", gamma, P, Q)


NEGATIVE_CASES = [  # gamma >= 2 everywhere, or a no-prefix rule would coincide with the right one
    _negative_case(),
    make_random(1),  # from the positive suite: V=4, gamma=4, zero-probability tokens
    make_random(10, zero_frac=0.0),  # from the positive suite: full supports, so only chi-square can tell
    make_from_logits(61, SamplingParams(temperature=0.7, top_k=3)),  # from the positive suite, gamma=3
]


@pytest.mark.stat
def test_reference_rule_is_correct():
    """The wrong verifiers differ from this one by a single switch; it must pass the same test."""
    for case in NEGATIVE_CASES:
        _, _, pvals = _run(make_rule(), case, seed=7)
        assert min(pvals.values()) > ALPHA, f"{case.name}: {_fmt(pvals)}"


@pytest.mark.stat
@pytest.mark.parametrize("case", NEGATIVE_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("wrong", list(WRONG_VERIFIERS), ids=str)
def test_wrong_verifier_is_detected(wrong, case):
    _, _, pvals = _run(WRONG_VERIFIERS[wrong], case)
    assert min(pvals.values()) < ALPHA, f"{wrong} not detected on {case.name}: {_fmt(pvals)}"


@pytest.mark.stat
def test_ignoring_q_is_lossless_but_accepts_less():
    """Treating a sampled draft as one-hot is still exact (valid for any fixed x) but lowers
    acceptance, which the acceptance-length law detects: that test has power of its own."""

    def ignore_q(p, q, draft_tokens, generator=None):
        return verify(p, None, draft_tokens, generator)

    case = _negative_case()
    out, first_acc, pvals = _run(ignore_q, case)
    assert min(pvals.values()) > ALPHA, _fmt(pvals)
    pv = gof_pvalue(np.bincount(first_acc.numpy(), minlength=case.gamma + 1), acceptance_probs(case))
    assert pv < ALPHA


def test_negative_cases_are_real_cases():
    names = {c.name for c in CASES}
    assert all(c.gamma >= 2 for c in NEGATIVE_CASES)
    assert sum(c.name in names for c in NEGATIVE_CASES) == len(NEGATIVE_CASES) - 1


@pytest.mark.stat
def test_draw_matches_probabilities():
    g = torch.Generator().manual_seed(3)
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    x = _draw(probs.expand(N, 6), g)
    assert gof_pvalue(np.bincount(x.numpy(), minlength=6), probs.double().numpy()) > ALPHA


def test_gof_pvalue_basics():
    probs = np.array([0.5, 0.25, 0.25, 0.0])
    assert gof_pvalue(np.array([500, 250, 250, 0]), probs) == pytest.approx(1.0)
    assert gof_pvalue(np.array([500, 250, 249, 1]), probs) == 0.0  # a zero-probability cell hit
    assert gof_pvalue(np.array([700, 150, 150, 0]), probs) < ALPHA
    assert gof_pvalue(np.array([10, 0, 0]), np.array([1.0, 0.0, 0.0])) == 1.0
    # tiny expected cells are merged rather than blowing up the statistic
    assert gof_pvalue(np.array([99_999, 1]), np.array([1 - 1e-6, 1e-6])) > ALPHA
