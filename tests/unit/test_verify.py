"""Deterministic tests for specdecode.verify.verify (the speculative sampling rule)."""

from __future__ import annotations

import pytest
import torch

from specdecode.sampling import SamplingParams, probs_from_logits
from specdecode.verify import verify


def one_hot(tokens, V):
    return torch.nn.functional.one_hot(torch.as_tensor(tokens), V).float()


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def check_output(accepted, next_token, B, gamma, V):
    assert accepted.shape == (B,) and next_token.shape == (B,)
    assert accepted.dtype == torch.long and next_token.dtype == torch.long
    assert ((accepted >= 0) & (accepted <= gamma)).all()
    assert ((next_token >= 0) & (next_token < V)).all()


# ----------------------------------------------------------------------------- all accepted + bonus


@pytest.mark.parametrize("with_q", [False, True])
def test_all_accepted_then_bonus_from_last_position(with_q):
    V, gamma = 7, 3
    draft = torch.tensor([[4, 1, 6], [0, 0, 2]])
    target = torch.tensor([[4, 1, 6, 5], [0, 0, 2, 3]])  # argmax of p at each position incl. bonus
    p = one_hot(target, V)
    q = one_hot(draft, V) if with_q else None
    for seed in range(5):
        accepted, next_token = verify(p, q, draft, gen(seed))
        check_output(accepted, next_token, 2, gamma, V)
        assert accepted.tolist() == [gamma, gamma]
        assert next_token.tolist() == [5, 3]


def test_all_accepted_bonus_is_sampled_from_p_gamma():
    V, gamma, B = 5, 2, 4000
    draft = torch.tensor([[2, 3]]).expand(B, gamma)
    bonus = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.5])
    p = torch.cat([one_hot([2, 3], V), bonus[None]]).expand(B, gamma + 1, V)
    accepted, next_token = verify(p, None, draft, gen(1))
    assert (accepted == gamma).all()
    assert set(next_token.unique().tolist()) == {1, 4}  # only the bonus support, both seen


# ----------------------------------------------------------------------------- greedy rejection


@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("reject_at", [0, 1, 2, 3])
def test_greedy_rejection_position_and_correction(reject_at, with_q):
    V, gamma = 9, 4
    target = torch.tensor([3, 8, 0, 5, 7])  # argmax tokens at positions 0..gamma
    draft = target[:gamma].clone()
    draft[reject_at] = (draft[reject_at] + 4) % V  # wrong guess here
    # later positions may also be wrong; they must be ignored
    if reject_at + 1 < gamma:
        draft[reject_at + 1] = (draft[reject_at + 1] + 1) % V
    logits = torch.randn(1, gamma + 1, V, generator=gen(reject_at))
    logits[0, torch.arange(gamma + 1), target] = 10.0
    p = probs_from_logits(logits, SamplingParams(temperature=0.0))
    q = one_hot(draft, V)[None] if with_q else None
    for seed in range(5):
        accepted, next_token = verify(p, q, draft[None], gen(seed))
        check_output(accepted, next_token, 1, gamma, V)
        assert accepted.item() == reject_at
        assert next_token.item() == target[reject_at].item()


def test_greedy_batch_with_random_drafts_matches_argmax_rule():
    V, gamma, B = 6, 4, 500
    g = gen(11)
    logits = torch.randn(B, gamma + 1, V, generator=g)
    p = probs_from_logits(logits, SamplingParams())
    target = logits.argmax(-1)
    # drafts agree with the target with probability ~0.7 per position
    agree = torch.rand(B, gamma, generator=g) < 0.7
    draft = torch.where(agree, target[:, :gamma], torch.randint(0, V, (B, gamma), generator=g))
    match = (draft == target[:, :gamma]).long()
    expected_acc = match.cumprod(-1).sum(-1)
    for q in (None, one_hot(draft, V)):
        accepted, next_token = verify(p, q, draft, gen(3))
        check_output(accepted, next_token, B, gamma, V)
        assert torch.equal(accepted, expected_acc)
        assert torch.equal(next_token, target[torch.arange(B), expected_acc])
    assert len(expected_acc.unique()) == gamma + 1  # every acceptance count occurred


# ----------------------------------------------------------------------------- empty draft


def test_empty_draft_samples_from_p0():
    V, B = 5, 3000
    p0 = torch.tensor([0.2, 0.0, 0.5, 0.0, 0.3])
    p = p0.expand(B, 1, V)
    draft = torch.zeros(B, 0, dtype=torch.long)
    for q in (None, torch.zeros(B, 0, V)):
        accepted, next_token = verify(p, q, draft, gen(2))
        check_output(accepted, next_token, B, 0, V)
        assert (accepted == 0).all()
        assert set(next_token.unique().tolist()) == {0, 2, 4}
        freq = torch.bincount(next_token, minlength=V).float() / B
        torch.testing.assert_close(freq, p0, atol=0.04, rtol=0)


def test_empty_draft_one_hot_p_is_exact():
    p = one_hot([[3], [1]], 4)
    accepted, next_token = verify(p, None, torch.zeros(2, 0, dtype=torch.long), gen())
    assert accepted.tolist() == [0, 0]
    assert next_token.tolist() == [3, 1]


# ----------------------------------------------------------------------------- disjoint / equal


def test_disjoint_supports_never_accept():
    V, gamma, B = 8, 3, 5000
    g = gen(5)
    # p lives on tokens 0..3, q on tokens 4..7
    p = torch.zeros(B, gamma + 1, V)
    p[..., :4] = torch.rand(B, gamma + 1, 4, generator=g) + 0.01
    p = p / p.sum(-1, keepdim=True)
    q = torch.zeros(B, gamma, V)
    q[..., 4:] = torch.rand(B, gamma, 4, generator=g) + 0.01
    q = q / q.sum(-1, keepdim=True)
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, gamma)
    accepted, next_token = verify(p, q, draft, gen(6))
    check_output(accepted, next_token, B, gamma, V)
    assert (accepted == 0).all()
    assert (next_token < 4).all()  # the residual is p itself, never the draft's support


def test_draft_token_with_zero_target_probability_is_never_accepted():
    # q puts most mass on token 0, which the target forbids; q(x)=0 tokens with p>0 may be accepted
    V, gamma, B = 4, 2, 5000
    p = torch.tensor([0.0, 0.5, 0.5, 0.0]).expand(B, gamma + 1, V)
    q = torch.tensor([0.9, 0.1, 0.0, 0.0]).expand(B, gamma, V)
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=gen(8)).reshape(B, gamma)
    accepted, next_token = verify(p, q, draft, gen(9))
    check_output(accepted, next_token, B, gamma, V)
    kept_first = accepted > 0
    assert (draft[kept_first, 0] == 1).all()
    assert (draft[accepted == 2] == 1).all()
    assert (next_token != 0).all() and (next_token != 3).all()
    # rejected rows: residual max(0, p - q) = [0, 0.4, 0.5, 0] -> never token 0/3
    assert kept_first.any() and (~kept_first).any()


@pytest.mark.parametrize("seed", range(4))
def test_p_equal_q_always_accepts_all(seed):
    V, gamma, B = 6, 4, 4000
    g = gen(seed)
    logits = torch.randn(B, gamma + 1, V, generator=g) * 2
    logits[..., 0] = -float("inf")  # zero-probability token included
    p = probs_from_logits(logits, SamplingParams(temperature=0.8, top_k=4))
    q = p[:, :gamma].clone()
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, gamma)
    accepted, next_token = verify(p, q, draft, gen(seed + 100))
    check_output(accepted, next_token, B, gamma, V)
    assert (accepted == gamma).all()
    assert (p[torch.arange(B), gamma, next_token] > 0).all()


# ----------------------------------------------------------------------------- batch


def test_batch_rows_with_different_acceptance_counts():
    V = 5
    draft = torch.tensor(
        [
            [1, 2, 3],  # all accepted -> bonus
            [1, 2, 0],  # rejected at position 2
            [4, 2, 3],  # rejected at position 0
            [1, 0, 3],  # rejected at position 1
        ]
    )
    target = torch.tensor(
        [
            [1, 2, 3, 4],
            [1, 2, 3, 0],
            [1, 2, 3, 4],
            [1, 2, 3, 4],
        ]
    )
    p = one_hot(target, V)
    for q in (None, one_hot(draft, V)):
        accepted, next_token = verify(p, q, draft, gen(4))
        assert accepted.tolist() == [3, 2, 0, 1]
        assert next_token.tolist() == [4, 3, 1, 2]


def test_batch_rows_use_their_own_distributions():
    # row 0: p == q (accept everything); row 1: disjoint (never accept)
    p = torch.tensor(
        [
            [[0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0], [0, 0, 0, 1.0]],
            [[0, 0, 0.5, 0.5], [0, 0, 0.5, 0.5], [1.0, 0, 0, 0]],
        ]
    )
    q = torch.tensor(
        [
            [[0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0]],
            [[0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0]],
        ]
    )
    draft = torch.tensor([[1, 0], [0, 1]])
    for seed in range(10):
        accepted, next_token = verify(p, q, draft, gen(seed))
        assert accepted.tolist() == [2, 0]
        assert next_token[0].item() == 3
        assert next_token[1].item() in (2, 3)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "p_shape, q_shape, d_shape",
    [
        ((2, 4, 5), (2, 3, 5), (2, 4)),  # draft has gamma+1 tokens
        ((2, 4, 5), (2, 3, 5), (2, 2)),  # draft too short
        ((2, 4, 5), (2, 3, 5), (3, 3)),  # batch mismatch in draft
        ((2, 4, 5), (3, 3, 5), (2, 3)),  # batch mismatch in q
        ((2, 4, 5), (2, 4, 5), (2, 3)),  # q has gamma+1 positions
        ((2, 4, 5), (2, 2, 5), (2, 3)),  # q has too few positions
        ((2, 4, 5), None, (2, 4)),
        ((2, 4, 5), None, (6,)),
    ],
)
def test_shape_mismatch_raises_value_error(p_shape, q_shape, d_shape):
    p = torch.full(p_shape, 1.0 / p_shape[-1])
    q = None if q_shape is None else torch.full(q_shape, 1.0 / q_shape[-1])
    draft = torch.zeros(d_shape, dtype=torch.long)
    with pytest.raises(ValueError, match="shape mismatch"):
        verify(p, q, draft, gen())


def test_vocab_mismatch_between_p_and_q_raises_value_error():
    p = torch.full((2, 3, 5), 0.2)
    q = torch.full((2, 2, 6), 1 / 6)
    with pytest.raises(ValueError):
        verify(p, q, torch.zeros(2, 2, dtype=torch.long), gen())


# ----------------------------------------------------------------------------- reproducibility


def _random_problem(seed, B=300, gamma=3, V=7):
    g = gen(seed)
    p = torch.softmax(torch.randn(B, gamma + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(B, gamma, V, generator=g) * 2, -1)
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, gamma)
    return p, q, draft


def test_reproducible_with_seeded_generator():
    p, q, draft = _random_problem(0)
    a = verify(p, q, draft, gen(123))
    b = verify(p, q, draft, gen(123))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = verify(p, q, draft, gen(124))
    assert not (torch.equal(a[0], c[0]) and torch.equal(a[1], c[1]))
    # results are a mix: some rows accept all, some reject somewhere
    assert 0 < (a[0] == 3).sum() < 300 and (a[0] == 0).any()


def test_verify_does_not_modify_inputs():
    p, q, draft = _random_problem(1)
    p0, q0, d0 = p.clone(), q.clone(), draft.clone()
    verify(p, q, draft, gen(5))
    verify(p, None, draft, gen(5))
    assert torch.equal(p, p0) and torch.equal(q, q0) and torch.equal(draft, d0)


def test_works_without_generator():
    p, q, draft = _random_problem(2, B=20)
    accepted, next_token = verify(p, q, draft)
    check_output(accepted, next_token, 20, 3, 7)


def test_verify_greedy_is_the_tree_rule_on_one_hot_rows():
    """The greedy fast path (engine: temperature 0, deterministic nodes) walks the same branch and
    returns the same token as verify_tree / verify on the one-hot rows, for random trees and chains."""
    import random

    from specdecode.verify import verify_greedy, verify_tree

    rng = random.Random(0)
    V = 6
    for trial in range(3000):
        n = rng.randint(0, 9)
        parents = [rng.randrange(-1, j) if rng.random() < 0.6 else j - 1 for j in range(n)]
        tokens = []
        for j in range(n):  # siblings differ (the drafters merge equal guesses)
            taken = {tokens[i] for i in range(j) if parents[i] == parents[j]}
            tokens.append(rng.choice([t for t in range(V) if t not in taken] or [0]))
        best = [rng.randrange(V) for _ in range(n + 1)]
        p = torch.zeros(n + 1, V).scatter_(-1, torch.tensor(best)[:, None], 1.0)
        want = verify_tree(p, tokens, parents, None, torch.Generator().manual_seed(trial))
        assert verify_greedy(best, tokens, parents) == want
        if parents == list(range(-1, n - 1)) and n:
            acc, bonus = verify(p[None], None, torch.tensor([tokens]), torch.Generator().manual_seed(trial))
            assert want == (list(range(int(acc[0]))), int(bonus[0]))
    with pytest.raises(ValueError):
        verify_greedy([1, 2], [3, 4], [-1, 0])
