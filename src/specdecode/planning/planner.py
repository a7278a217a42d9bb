"""The cost decisions of a token tree: what to grow, what to verify, when to stop running the draft model.

Each choice maximises expected tokens per second on the measured pass costs (costs.CostModel):
(1 + sum of the kept nodes' values) / (draft seconds + target seconds for N+1 tokens), where a
node's value is the estimated probability that the target accepts the whole path to it
(calibration.py). Units: seconds from the cost model; rates in tokens per second.
"""

from __future__ import annotations

from .calibration import PRIOR_WEIGHT, Acceptance
from .costs import CostModel

MAX_WIDTH, MAX_DEPTH, MAX_NODES = 4, 8, 32  # caps of an adaptive tree (EAGLE-2 verifies up to ~60 nodes
# on a GPU; on a CPU a 32-token pass already costs 3-8 plain steps, so the planner rarely wants more)
MASS_COVER = 0.8  # without a cost model, draw children until they cover 80% of the draft's q

# The per-token acceptance the auto method grants a draft model before it has run it: about the best a
# same-family draft reaches (the default pair accepts 0.9-0.95 of its greedy guesses on easy code).
AUTO_ALPHA = 0.9
AUTO_MARGIN = 1.15  # and it must then beat plain decoding by 15%: a chain modelled a little faster realised less,
# and probing the draft costs more than that gains (measured: docs/results/notes.md#code-auto-margin)

# Backing off: when the steps with the draft model yield fewer tokens per second than those without
# (after BACKOFF_AFTER steps with it), skip it for `backoff` steps, doubling up to BACKOFF_MAX; after
# BACKOFF_RESET good steps in a row, back to BACKOFF_FIRST. A wrong guess so costs at most ~1/8 of the steps.
BACKOFF_FIRST, BACKOFF_MAX, BACKOFF_AFTER, BACKOFF_RESET = 8, 256, 8, 32
RATE_DECAY = 0.9  # the modelled rate's moving average: about the last 10 steps
MEASURED_DECAY = 0.95  # of the measured rates: about the last 20 steps of each kind count
MEASURED_MIN_TOKENS = 4.0  # a measured rate is used once it covers this many (decayed) tokens


def chain_speedup(costs: CostModel, alpha: float, max_depth: int = MAX_DEPTH) -> float:
    """The best modelled speedup of a draft-model chain over plain decoding on these measured costs,
    at per-token acceptance alpha: max over k of E[tokens] / (k draft passes + a (k+1)-token target
    pass), in units of one plain step (Leviathan et al.'s Theorem 3.8 with the measured T(k+1))."""
    best = 0.0
    for k in range(1, max_depth + 1):
        tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
        best = max(best, tokens * costs.t(1) / (k * costs.d(1) + costs.t(k + 1)))
    return best


def draft_model_can_pay(costs: CostModel, alpha: float = AUTO_ALPHA, window: int | None = None) -> bool:
    """Whether the auto method should load the draft model into its plan at all on this machine: at
    some measured context length (the draft seeing at most `window` tokens) a chain could beat plain
    decoding by AUTO_MARGIN. Where it cannot (llama.cpp on 2 cores: a draft pass at ~0.5 and a 2-token
    pass at ~1.6 plain steps) auto never runs it, and decodes plainly or with free lookup guesses."""
    if not costs.draft:
        return False
    key = ("draft_model_can_pay", alpha, window)
    # asked once per generation; kept where the answer depends on the tables alone (not on company)
    memo = costs.memo if costs.static else {}
    if key not in memo:
        memo[key] = any(
            chain_speedup(costs.at(c, c if window is None else min(c, window)), alpha) > AUTO_MARGIN
            for c in costs.contexts
        )
    return memo[key]


def pays(costs: CostModel, spent: float, e: float, n: int, v: float) -> bool:
    """Whether one more node worth v raises the expected rate of a tree of n nodes worth e tokens,
    after `spent` seconds of drafting."""
    return (e + v) / (spent + costs.t(n + 2)) > e / (spent + costs.t(n + 1))


def best_cut(
    values: list[float], costs: CostModel, spent: float, keep_all: bool, max_nodes: int, measured_only: bool = False
):
    """(rate, N, expected tokens) of the best tree cut from nodes ranked by value (a node is never
    worth more than its parent, so any prefix of the ranking is a tree). keep_all: nothing may be
    pruned (drawn nodes). measured_only: only passes of a size the cost model timed (a tiled kernel's cost
    between two timed sizes may jump rather than follow the line between them)."""
    if keep_all:
        e = 1.0 + sum(values)
        return e / (spent + costs.t(len(values) + 1)), len(values), e
    best = (1.0 / (spent + costs.t(1)), 0, 1.0)
    e = 1.0
    for n, v in enumerate(values[:max_nodes], 1):
        e += v
        if measured_only and n + 1 not in costs.target:
            continue
        rate = e / (spent + costs.t(n + 1))
        if rate > best[0]:
            best = (rate, n, e)
    return best


def frontier_width(
    ranked_gains: list[float],
    costs: CostModel,
    spent: float,
    best,
    draft_s,
    rho: float,
    fixed_width: int | None,
    must_expand: bool,
) -> int:
    """How many of the ranked frontier nodes to expand by one more draft pass: the count whose
    expected gain (rho x their values) per second beats the best tree without expanding. 0: stop."""
    best_rate, n_best, e_best = best
    choice, choice_rate = 0, best_rate
    for w in range(1, len(ranked_gains) + 1):
        if fixed_width is not None and w != len(ranked_gains):
            continue
        gain = rho * sum(ranked_gains[:w])
        rate = (e_best + gain) / (spent + draft_s(w) + costs.t(n_best + w + 1))
        if rate > choice_rate or must_expand and not choice:
            choice, choice_rate = w, rate
    return choice


class TreeState(Acceptance):
    """What one generation learns online: the calibrations, and whether the draft model pays."""

    def __init__(self):
        super().__init__()
        self.rate = None  # moving average of modelled tokens per second while speculating
        self.steps = 0
        self.plain_left = 0  # steps to take without the draft model before trying it again
        self.backoff = BACKOFF_FIRST
        # measured, not modelled: decayed sums of (tokens emitted, wall seconds) of the steps that ran the
        # draft model (True) and of those that did not (False). A cost model measured once can be off
        # (another process was busy then, the machine changed speed); the two measured rates cannot.
        self.measured = {True: [0.0, 0.0], False: [0.0, 0.0]}
        self.measure = False  # decide by the measured rates (the auto method) rather than the modelled ones
        self.totals = {True: [0, 0.0], False: [0, 0.0]}  # (tokens, modelled seconds) of each kind of step, all

    def draft_alpha(self) -> float:
        """The draft's per-token acceptance along a chain (its first choices), learned in this generation
        from the prior AUTO_ALPHA (worth PRIOR_WEIGHT verdicts)."""
        hits, tries = self.first
        return (hits + PRIOR_WEIGHT * AUTO_ALPHA) / (tries + PRIOR_WEIGHT)

    def measured_rate(self, with_model: bool) -> float | None:
        tokens, seconds = self.measured[with_model]
        return tokens / seconds if tokens >= MEASURED_MIN_TOKENS and seconds > 0 else None

    def generation_rate(self, with_model: bool) -> float | None:
        """Tokens per modelled second of this generation's steps with (or without) the draft model so far: the
        cost model's seconds of the passes they ran, so that it compares with the cost model's other rates."""
        tokens, seconds = self.totals[with_model]
        return tokens / seconds if tokens >= MEASURED_MIN_TOKENS and seconds > 0 else None

    def record_step(self, with_model: bool, tokens: int, seconds: float, modelled_s: float | None = None) -> None:
        t, s = self.measured[with_model]
        self.measured[with_model] = [MEASURED_DECAY * t + tokens, MEASURED_DECAY * s + seconds]
        if modelled_s is not None:
            self.totals[with_model][0] += tokens
            self.totals[with_model][1] += modelled_s

    def learn_rate(self, rate: float, plain_rate: float) -> None:
        """After a step with the draft model (modelled rate `rate`): stop using it for a while when its
        rate stays below that of the steps without it: measured wall-clock rates once both kinds of
        step have run (with measure), the cost model's (against plain_rate) before."""
        self.rate = rate if self.rate is None else RATE_DECAY * self.rate + (1 - RATE_DECAY) * rate
        self.steps += 1
        with_model, without = (self.measured_rate(True), self.measured_rate(False)) if self.measure else (None, None)
        losing = with_model < without if with_model is not None and without is not None else self.rate < plain_rate
        if self.steps >= BACKOFF_AFTER and losing:
            self.plain_left, self.backoff = self.backoff, min(2 * self.backoff, BACKOFF_MAX)
            self.rate, self.steps = None, 0
        elif self.steps >= BACKOFF_RESET:
            self.backoff = BACKOFF_FIRST
