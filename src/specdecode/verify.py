"""The speculative sampling rule (Leviathan et al. 2023, Chen et al. 2023) as a pure function.

Accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample
from the residual norm(max(0, p_i - q_i)); when all gamma are accepted, sample a bonus token from
p_gamma. The emitted tokens then follow the target distribution exactly. A deterministic drafter
(greedy draft model, prompt lookup) has a one-hot q, passed as q=None.

`verify` is the chain rule, batched over a leading dimension so that sequences with different
acceptance counts can share a target pass. `verify_tree` is its multi-branch form for token trees
(SpecInfer's multi-step speculative sampling, Miao et al. 2024; recursive rejection sampling, Jeon
et al. 2024): at each node try the children in turn, accepting child x with probability
min(1, p(x)/q(x)), and after each rejection replace p by the normalized residual max(0, p - q)
before trying the next child; when every child is rejected, sample from what is left of p.
"""

from __future__ import annotations

import torch

from .sampling import argmax, probs_from_logits, sample


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
        raise ValueError(
            f"shape mismatch: p {tuple(p.shape)}, q {None if q is None else tuple(q.shape)}, "
            f"draft_tokens {tuple(draft_tokens.shape)}"
        )
    if gamma == 0:
        return torch.zeros(B, dtype=torch.long, device=p.device), sample(p[:, 0], generator)

    idx = draft_tokens.unsqueeze(-1)
    px = p[:, :gamma].gather(-1, idx).squeeze(-1)  # [B, gamma]
    u = torch.rand(B, gamma, generator=generator, device=p.device)
    # u < p/q written without the division: a token the draft could not have proposed (q = 0)
    # is still accepted only where p > 0, and p = 0 is never accepted. (One-hot q: u * 1 is u.)
    ok = u < px if q is None else u * q.gather(-1, idx).squeeze(-1) < px
    accepted = ok.cumprod(-1).sum(-1)  # [B] length of the accepted prefix (a bool cumprod is int64)

    rows = torch.arange(B, device=p.device)
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


def verify_tree(
    p: torch.Tensor,
    tokens: list[int],
    parents: list[int],
    q: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Walk a token tree from its root and decide which branch to keep and which token follows it.

    p:       [n+1, V] target probabilities; p[0] is the distribution after the root (the last
             committed token), p[i+1] the one after node i.
    tokens:  [n] node token ids; parents: [n] parent node index (-1 = the root), parent before child.
             Children are tried in node order.
    q:       [n, V] the distribution each node was drawn from, or None when every node was chosen
             deterministically (one-hot q: accept with probability p(x), on rejection drop x from p).
    Returns (path, next_token): the accepted node indices from the root down, and the token after them.

    Lossless when each node's token was drawn from its q row given only draft-side information and
    its earlier siblings, and a drawn node's presence was decided before its token was drawn;
    deterministic (one-hot) nodes may be chosen by any rule that does not look at the target.
    A chain (parents = [-1, 0, 1, ...]) is exactly the rule of `verify`.
    """
    n = len(tokens)
    if len(parents) != n or p.shape[0] != n + 1 or (q is not None and q.shape != (n, p.shape[-1])):
        raise ValueError(
            f"shape mismatch: p {tuple(p.shape)}, {n} tokens, {len(parents)} parents, "
            f"q {None if q is None else tuple(q.shape)}"
        )
    children: list[list[int]] = [[] for _ in range(n + 1)]  # by p row: row 0 = root, row i+1 = node i
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}; a parent must come before its child")
        children[parent + 1].append(i)
    path: list[int] = []
    row = 0
    while True:
        dist = p[row]
        for child in children[row]:
            x = tokens[child]
            qx = 1.0 if q is None else float(q[child, x])
            u = float(torch.rand((), generator=generator))
            if u * qx < float(dist[x]):  # u < p/q without dividing (see verify)
                path.append(child)
                row = child + 1
                break
            if q is None:
                residual = dist.clone()
                residual[x] = 0.0
            else:
                residual = (dist - q[child]).clamp(min=0)
            mass = residual.sum()
            # p == q up to rounding leaves no residual mass; that rejection had probability ~0
            if float(mass) > 0:
                dist = residual / mass
        else:
            return path, int(sample(dist, generator))


def verify_greedy(best: list[int], tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """`verify_tree` at temperature 0, on the target's argmax alone: best[0] is the target's token
    after the root, best[i+1] the one after node i. With a one-hot p every deterministic node is
    accepted iff it is that token, and after the rejections only the argmax is left: so walk down the
    children that equal it (the first such child in node order) and return (path, the argmax after
    the path). Saves building and sampling [n+1, V] one-hot rows each step (a few ms on a 150k vocabulary)."""
    if len(best) != len(tokens) + 1 or len(parents) != len(tokens):
        raise ValueError(f"{len(best)} target rows for {len(tokens)} tokens and {len(parents)} parents")
    path: list[int] = []
    at = -1
    while True:
        want = best[at + 1]
        child = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == at and t == want), None)
        if child is None:
            return path, want
        path.append(child)
        at = child


def verdict(logits: torch.Tensor, draft, params, generator: torch.Generator | None) -> tuple[list[int], int]:
    """The target's verdict on a drafters.Draft (sampling.SamplingParams params), from its logits after the root and
    each drafted node: the accepted nodes (a branch, root side first) and the token that follows them (a correction or
    the bonus)."""
    if params.greedy and draft.q is None:  # one-hot p and q: the rule reduces to following the argmax
        return verify_greedy(argmax(logits), draft.tokens, draft.tree_parents)
    if draft.parents is None:  # a chain: the batched rule
        p = probs_from_logits(logits, params)  # [n+1, V]
        q = None if draft.q is None else draft.q[None]
        accepted, bonus = verify(p[None], q, torch.tensor([draft.tokens], dtype=torch.long), generator)
        return list(range(int(accepted[0]))), int(bonus[0])
    return verify_tree(probs_from_logits(logits, params), draft.tokens, draft.parents, draft.q, generator)
