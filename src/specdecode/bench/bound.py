"""What a perfect copy could decode at, on this machine's measured pass costs: the bounds an edit's answer is judged by.

A copy that is always right emits k tokens per k-token pass (k - 1 guesses and the bonus), so its best rate at a
context of c cached tokens is max over the timed sizes k of k / T(k, c). Summed over the answer's own tokens, each at
the context it is written at, this gives the decode time no drafter can beat on these costs (`copy_bound`); the bench
reports it beside `auto` with the share of the answer that copies the prediction (the generation's
accepted_prediction_tokens over its tokens). Two more figures say where the rest goes:

- `timed_copy_bound`: the same perfect copy run on the target itself in the bench's own minutes (its passes verify the
  answer's own tokens), so the machine's speed at that time is in it as it is in the answer's decoding;
- `oracle_bound`: the best plan that knows in advance where the answer leaves the prediction (an inserted or changed
  token is a pass's bonus or a plain step; a copied run is verified in the passes that cost least), on the measured
  costs: no drafter that learns the edit points only when the target writes them can beat it.
"""

from __future__ import annotations

import time
from difflib import SequenceMatcher

from ..backends.base import common_start
from ..planning.costs import CostModel

COPIED = 0.95  # an answer that copies at least this share of its prediction is judged against the perfect-copy bound


def _best_size(costs: CostModel, context: int, left: int) -> int:
    """The timed pass size that costs least per token at this context, at most `left` tokens."""
    sizes = [k for k in sorted(costs.target) if k <= left] or [1]
    return min(sizes, key=lambda k: costs.t(k, context) / k)


def copy_bound(costs: CostModel, prompt_tokens: int, new_tokens: int) -> float | None:
    """Tokens per second of a perfect copy of `new_tokens` after a prompt of `prompt_tokens` (decoding only: the first
    token comes from the prompt's read); None where there is nothing to decode."""
    if new_tokens < 2:
        return None
    sizes = sorted(costs.target)
    seconds = sum(min(costs.t(k, prompt_tokens + i) / k for k in sizes) for i in range(1, new_tokens))
    return (new_tokens - 1) / seconds


def oracle_bound(costs: CostModel, prompt_tokens: int, answer: list[int], prediction: list[int]) -> float | None:
    """Tokens per second of the fastest plan that knows which of the answer's tokens copy the prediction (difflib's
    matching blocks of the two, a diff close to their longest common subsequence): from each point, a pass of any
    timed size k emits min(k, copied run ahead + 1) tokens at cost T(k) (a pass may be padded up to a cheaper tile).
    None where there is nothing to decode."""
    n = len(answer)
    if n < 2:
        return None
    copied = [False] * n
    for block in SequenceMatcher(None, prediction, answer, autojunk=False).get_matching_blocks():
        copied[block.b : block.b + block.size] = [True] * block.size
    run = [0] * (n + 1)  # copied tokens in a row from each point
    for i in range(n - 1, -1, -1):
        run[i] = run[i + 1] + 1 if copied[i] else 0
    sizes = sorted(costs.target)
    best = [float("inf")] * (n + 1)  # least seconds to have written answer[:i]
    best[1] = 0.0
    for i in range(1, n):
        for k in sizes:
            j = min(n, i + min(k, run[i] + 1))
            best[j] = min(best[j], best[i] + costs.t(k, prompt_tokens + i))
    return (n - 1) / best[n]


def timed_copy_bound(lm, costs: CostModel, prompt_ids: list[int], answer: list[int]) -> float | None:
    """Tokens per second of a perfect copy of `answer` run on `lm` now: after the prompt is read (not timed), each pass
    verifies the answer's next tokens in the size `copy_bound` prices best at its context, and its greedy verdicts
    are read (argmax per row). The prompt is read only where the cache does not hold it already. Leaves the cache
    empty. None where there is nothing to decode."""
    if len(answer) < 2:
        return None
    prompt = list(prompt_ids)
    # the prompt's committed cells are kept where the cache holds them (the answer's generation left them there)
    kept = common_start(lm.ids, prompt, min(getattr(lm, "trunk", 0), len(prompt)))
    if kept:
        lm.rollback(kept)
    else:
        lm.reset()
    if kept < len(prompt):
        lm.forward(prompt[kept:], last_only=True)
    seconds, i = 0.0, 1
    while i < len(answer):
        k = _best_size(costs, len(prompt) + i, len(answer) - i)
        t = time.perf_counter()
        lm.forward(answer[i - 1 : i - 1 + k]).argmax(-1).tolist()
        lm.synchronize()
        seconds += time.perf_counter() - t
        i += k
    lm.reset()
    return (len(answer) - 1) / seconds
