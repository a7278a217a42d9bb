"""How much of a client's prediction the answer used: OpenAI's usage fields for Predicted Outputs, counted once
when a generation ends, from the prediction's tokens and the completion's.

- accepted_prediction_tokens: the prediction's tokens that appear in the completion along their best alignment,
  the longest common subsequence (LCS) of the two token sequences (the diff that keeps the most of the prediction);
  an inserted span, a deleted one or a changed one costs only the prediction tokens it removed or replaced.
- rejected_prediction_tokens: the prediction's tokens that do not appear in it (OpenAI: "tokens in the prediction
  that did not appear in the completion"), among those the completion could have reached. Where the answer ended on
  its own (an end-of-text token or a stop string) that is the whole prediction. Where it was cut (max_tokens, the
  context, a deadline) the rest is unknown, and OpenAI defines no count for it (its Predicted Outputs do not take
  max_completion_tokens): the prediction counts up to the last token the completion used, plus one token for each
  token the completion wrote after that one (they could have been the prediction's next ones).

How much the speculation drafted from the prediction is another count: Stats.sources["prediction"].

Work: two bit-parallel LCS passes (Hyyrö 2004) over what lies between the common start and end, each about
|prediction| x |completion| / 30 machine-word operations on Python's integers (32k x 32k tokens: well under a
second; an edit's few thousand tokens: milliseconds); memory: one integer of |prediction| bits per distinct token.
"""

from __future__ import annotations

from typing import Sequence


def prediction_usage(prediction: Sequence[int], completion: Sequence[int], finished: bool) -> tuple[int, int]:
    """(accepted_prediction_tokens, rejected_prediction_tokens) of a completion (token ids) against the prediction
    (token ids). finished: the answer ended on its own (an end-of-text token, a stop string), not cut short."""
    pred, out = list(prediction), list(completion)
    head = 0  # a common start is aligned token for token (an LCS can always take it)
    while head < min(len(pred), len(out)) and pred[head] == out[head]:
        head += 1
    tail = 0  # so is a common end, where the completion has one (a cut one might not reach it)
    if finished:
        while tail < min(len(pred), len(out)) - head and pred[-1 - tail] == out[-1 - tail]:
            tail += 1
    a, b = pred[head : len(pred) - tail], out[head : len(out) - tail]
    common, reach = _lcs_reach(a, b)
    accepted = head + common + tail
    if finished:
        return accepted, len(pred) - accepted
    used = _lcs_reach(b, a[:reach])[1]  # the completion's tokens up to the last one aligned within a[:reach]
    considered = head + min(len(a), reach + len(b) - used)
    return accepted, considered - accepted


def _lcs_reach(x: Sequence[int], y: Sequence[int]) -> tuple[int, int]:
    """(the length L of the longest common subsequence of x and y, the shortest prefix of x that has L in common
    with y). Bit i of v is 0 where LCS(x[:i + 1], y) > LCS(x[:i], y): one row of the LCS table, all of x at once."""
    if not x or not y:
        return 0, 0
    masks: dict[int, int] = {}  # token -> the bits of its positions in x (only tokens of y can match)
    wanted = set(y)
    for i, token in enumerate(x):
        if token in wanted:
            masks[token] = masks.get(token, 0) | (1 << i)
    full = (1 << len(x)) - 1
    v = full
    for token in y:
        m = masks.get(token)
        if m:
            u = v & m
            v = ((v + u) | (v - u)) & full
    rises = ~v & full
    return rises.bit_count(), rises.bit_length()
