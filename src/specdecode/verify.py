"""The speculative sampling rule (Leviathan et al. 2023, Chen et al. 2023) as a pure function.

Accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample
from the residual norm(max(0, p_i - q_i)); when all gamma are accepted, sample a bonus token from
p_gamma. The emitted tokens then follow the target distribution exactly. A deterministic drafter
(greedy draft model, prompt lookup) has a one-hot q, passed as q=None.

Batched over a leading dimension so that sequences with different acceptance counts can share a
target pass later; a token tree needs its own multi-branch rule (issue 5) on top of the same pieces.
"""
from __future__ import annotations

import torch

from .sampling import sample


def verify(
    p: torch.Tensor,
    q: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decide how many draft tokens to keep and which token follows them.

    p:            [B, gamma+1, V] target probabilities; p[:, i] is the distribution of the token
                  at draft position i (i = gamma: the bonus position).
    q:            [B, gamma, V] draft probabilities, or None for a deterministic (one-hot) drafter.
    draft_tokens: [B, gamma] proposed token ids.
    Returns (accepted [B], next_token [B]): the first accepted[b] draft tokens are kept and
    next_token[b] (the residual sample, or the bonus) is appended.
    """
    B, g1, _ = p.shape
    gamma = g1 - 1
    if draft_tokens.shape != (B, gamma) or (q is not None and q.shape != (B, gamma, p.shape[-1])):
        raise ValueError(f"shape mismatch: p {tuple(p.shape)}, q {None if q is None else tuple(q.shape)}, "
                         f"draft_tokens {tuple(draft_tokens.shape)}")
    rows = torch.arange(B, device=p.device)
    if gamma == 0:
        return torch.zeros(B, dtype=torch.long, device=p.device), sample(p[:, 0], generator)

    idx = draft_tokens.unsqueeze(-1)
    px = p[:, :gamma].gather(-1, idx).squeeze(-1)  # [B, gamma]
    qx = torch.ones_like(px) if q is None else q.gather(-1, idx).squeeze(-1)
    u = torch.rand(B, gamma, generator=generator, device=p.device)
    # u < p/q written without the division: a token the draft could not have proposed (q = 0)
    # is still accepted only where p > 0, and p = 0 is never accepted.
    ok = u * qx < px
    accepted = ok.long().cumprod(-1).sum(-1)  # [B] length of the accepted prefix

    p_n = p[rows, accepted]  # [B, V] target distribution at the first rejected (or bonus) position
    rejected = accepted < gamma
    at = accepted.clamp(max=gamma - 1)
    if q is None:
        q_n = torch.zeros_like(p_n).scatter_(-1, draft_tokens[rows, at].unsqueeze(-1), 1.0)
    else:
        q_n = q[rows, at]
    residual = torch.where(rejected.unsqueeze(-1), (p_n - q_n).clamp(min=0), p_n)
    mass = residual.sum(-1, keepdim=True)
    # p == q up to rounding can leave no residual mass; rejection then had probability ~0 anyway.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_n)
    return accepted, sample(residual, generator)
