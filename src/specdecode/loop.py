"""The speculative decoding loop: draft -> verify -> accept and roll back -> emit, one step per target pass.

Cache convention (both models): the cache holds every committed token except the last one, which goes
into the next target pass with the draft: the target scores gamma draft tokens plus the bonus position in
ONE forward of gamma+1 tokens. Plain decoding is the same loop with an empty draft.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from .backends import LM
from .drafters import Draft, Drafter
from .exactness import ExactDrafter, ExactLimits
from .prefill import Interrupt, prefill
from .sampling import SamplingParams
from .stats import Stats
from .verify import verdict


def speculative_decode(
    target: LM,
    drafter: Drafter | None,
    prompt_ids: list[int],
    *,
    gamma: int,
    params: SamplingParams,
    max_new_tokens: int,
    eos_ids: set[int],
    generator: torch.Generator | None,
    stats: Stats,
    exact: ExactLimits | None = None,
    scope: str | None = None,
    interrupt: Interrupt | None = None,
) -> Iterator[list[int]]:
    """Yield newly committed token ids, step by step. stats is filled in as it goes. gamma: the most
    tokens deep one step may draft (a chain's length; a tree drafter's depth cap), never more than can
    still be emitted. exact: passes kept to the sizes (and chains, if trees are not) whose logits are
    bit-identical to plain decoding's (exactness.ExactDrafter keeps the drafter within them; a plain step is exact
    by definition). interrupt: asked between the prompt's passes (prefill)."""
    if exact is not None and drafter is not None:
        drafter = ExactDrafter(drafter, exact, target)
    with torch.inference_mode():
        ids, head = prefill(
            target,
            drafter,
            prompt_ids,
            max_new_tokens,
            stats,
            exact is not None or params.greedy,
            scope,
            interrupt,
            exact=exact is not None,
        )
    emitted = len(head)
    if head:
        stats.record(Draft([], None), 0, 1)
        stats.new_tokens, stats.finish_reason = 1, "eos" if head[0] in eos_ids else None
        yield head
        if stats.finish_reason:
            return
    while True:
        room = min(max_new_tokens - emitted, target.max_length - len(ids))
        if room <= 0:
            stats.finish_reason = "length"
            return
        g = min(gamma, room - 1) if drafter is not None else 0  # never draft what cannot be emitted

        with torch.inference_mode():  # a step only reads the models (once here, not in every pass and rollback)
            # 1. draft: guesses that continue ids (a chain or a tree; none for plain decoding)
            t0 = time.perf_counter()
            draft = drafter.propose(ids, g, params, generator) if g > 0 else Draft([], None)
            t1 = time.perf_counter()
            # 2. verify: the ONE target pass over the last committed token (the root) and every drafted token
            root = len(target)
            logits = target.forward(
                [ids[-1]] + draft.tokens, parents=[root - 1] + [root + a + 1 for a in draft.tree_parents]
            )
            # 3. accept and roll back: the accepted path and one token of the target's own (bonus or residual);
            # the caches keep ids + the accepted branch, the new last token stays uncached
            path, bonus = verdict(logits, draft, params, generator)
            target.rollback(len(ids), [root + 1 + i for i in path])
            if drafter is not None and g > 0:
                drafter.commit(len(ids), path, bonus)
        stats.draft_s += t1 - t0
        stats.verify_s += time.perf_counter() - t1

        # 4. emit: the accepted tokens and the bonus, cut at an end-of-generation token
        new = [draft.tokens[i] for i in path] + [bonus]
        for i, tok in enumerate(new):
            if tok in eos_ids:
                new = new[: i + 1]
                stats.finish_reason = "eos"
                break
        stats.record(draft, min(len(path), len(new)), len(new), path)  # accepted draft tokens emitted (none past EOS)
        ids += new
        emitted += len(new)
        stats.new_tokens = emitted
        yield new
        if stats.finish_reason:
            return
