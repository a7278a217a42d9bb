"""What a perfect copy could decode at, on this machine's measured pass costs: the bound an edit's answer is judged by.

A copy that is always right emits k tokens per k-token pass (k - 1 guesses and the bonus), so its best rate at a
context of c cached tokens is max over the timed sizes k of k / T(k, c). Summed over the answer's own tokens, each at
the context it is written at, this gives the decode time no drafter can beat on these costs; the bench reports it
beside `auto` with the share of the answer that copies the prediction (the generation's accepted_prediction_tokens
over its tokens).
"""

from __future__ import annotations

from ..planning.costs import CostModel


def copy_bound(costs: CostModel, prompt_tokens: int, new_tokens: int) -> float | None:
    """Tokens per second of a perfect copy of `new_tokens` after a prompt of `prompt_tokens` (decoding only: the first
    token comes from the prompt's read); None where there is nothing to decode."""
    if new_tokens < 2:
        return None
    sizes = sorted(costs.target)
    seconds = sum(min(costs.t(k, prompt_tokens + i) / k for k in sizes) for i in range(1, new_tokens))
    return (new_tokens - 1) / seconds
