"""What a forward pass costs, and how often a drafted token is accepted: the numbers a token tree
is shaped by.

CostModel: seconds for one target pass over n tokens and one draft pass over k tokens, measured
once per machine, model, dtype, device and thread count, and cached as JSON under the cache dir.
(Calibration, the acceptance learned online, lives in calibration.py and is re-exported here.)
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from bisect import bisect_left
from dataclasses import dataclass, field

from ..host import cache_dir, cpu_name as _cpu_name, write_json  # _cpu_name: the old name, kept
from .calibration import Calibration  # noqa: F401  (re-exported)

# up to a followed copy's deepest chain (tree.MAX_COPY_DEPTH); every size is timed, within MEASURE_BUDGET_S: on tiled
# kernels a bigger pass can cost less per token, even less in all, than a smaller one (docs/design/cost-model.md)
TARGET_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64, 96, 128)
DRAFT_SIZES = (1, 2, 4, 8)
DRAFT_READ = 128  # one draft pass over this many tokens: what catching the draft up on unseen text costs
CONTEXT = 128  # tokens already cached when timing the base table: a typical short prompt
LONG_CONTEXTS = (1024, 2048)  # also timed where the model's context holds them: attention grows with the text
LONG_SIZES = 128  # at the long contexts, passes up to this many tokens: a followed copy's deepest (tree.MAX_COPY_DEPTH)
FORMAT = 6  # the cache file's format: tables at several contexts, measured as they are (not made monotone), every pass
# on the one compute thread (backends/compute.py), target passes up to 128 tokens with no stop on a size's cost, at
# every context
MEASURE_BUDGET_S = 60.0  # the base table's first round stops adding sizes once it has taken a third of this: a slow
# machine (bf16 torch without AMX) extrapolates its biggest passes rather than spend minutes on its first run
# the long-context tables are timed only while their estimated time (reading the context, then the passes) fits
# this budget: on a slow machine (bf16 torch on an AVX2-only CPU: minutes per table) the first run stays short,
# and the costs there do not depend on the context length
LONG_BUDGET_S = 120.0


@dataclass
class CostModel:
    """Seconds of one pass. target/draft: over n new tokens after CONTEXT cached ones; target_at/draft_at:
    the same after other context lengths (ctx -> table). A pass's cost at another context is interpolated
    linearly between the measured contexts and continued past the last (attention is linear in the
    context). Tables keep what was measured: on some CPUs a 4-token pass is cheaper than a 3-token one
    (llama.cpp's repacked gemm takes tokens in groups of 4), and the planner may use that."""

    target: dict[int, float]  # tokens in one target pass -> seconds
    draft: dict[int, float] = field(default_factory=dict)  # tokens in one draft pass -> seconds
    target_at: dict[int, dict[int, float]] = field(default_factory=dict)  # longer contexts
    draft_at: dict[int, dict[int, float]] = field(default_factory=dict)
    # answers that depend on the tables alone (draft_model_can_pay), computed once: these tables are never changed
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # bumped where a table is updated in place (batch.CallCostTracker, the calls' table): what was cut on it is stale
    version: int = field(default=0, init=False, repr=False, compare=False)
    static = True  # (a class attribute) costs that depend on the tables alone; batch.BatchPricing's do not

    def t(self, n: int, context: int | None = None) -> float:
        return _at_context(self.target, self.target_at, n, context)

    def d(self, k: int, context: int | None = None) -> float:
        return _at_context(self.draft, self.draft_at, k, context) if self.draft else 0.0

    def read(self, m: int, context: int | None = None) -> float:
        """Seconds for the draft model to read m tokens it has not seen (catching up), in one pass."""
        return self.d(m, context) if m > 0 else 0.0

    @property
    def contexts(self) -> list[int]:
        return sorted({CONTEXT, *self.target_at})

    def at(self, context: int, draft_context: int | None = None) -> "CostModel":
        """The same costs, evaluated at `context` cached target tokens (and draft_context draft tokens,
        default the same): a plain CostModel whose t() and d() need no context."""
        dc = context if draft_context is None else draft_context
        return CostModel(
            {n: self.t(n, context) for n in self.target}, {k: self.d(k, dc) for k in self.draft} if self.draft else {}
        )

    def as_dict(self) -> dict:
        """Costs relative to one plain decoding step (a 1-token target pass after CONTEXT tokens)."""
        one = self.t(1)
        return {
            "target_s_1": one,
            "target": {n: s / one for n, s in self.target.items()},
            "draft": {k: s / one for k, s in self.draft.items()},
            "context": CONTEXT,
            "target_at": {c: {n: s / one for n, s in tab.items()} for c, tab in self.target_at.items()},
            "draft_at": {c: {k: s / one for k, s in tab.items()} for c, tab in self.draft_at.items()},
        }


def _interpolate(table: dict[int, float], n: int) -> float:
    here = table.get(n)
    if here is not None:  # a measured size (the planner asks for these almost always)
        return here
    xs = sorted(table)
    if n <= xs[0]:
        return table[xs[0]] * n / xs[0]
    if n > xs[-1]:  # beyond the last point: the last segment's slope, or the whole table's if that is steeper
        # (a last segment that falls, where a faster kernel starts, must not make every bigger pass cheaper still:
        # docs/results/notes.md#code-extrapolation)
        b = xs[-1]
        a, first = (xs[-2], xs[0]) if len(xs) > 1 else (0, 0)  # one point: through the origin (proportional)
        slope = max((table[b] - table.get(a, 0.0)) / (b - a), (table[b] - table.get(first, 0.0)) / (b - first))
        return table[b] + slope * (n - b)
    i = bisect_left(xs, n)
    a, b = xs[i - 1], xs[i]
    return table[a] + (table[b] - table[a]) * (n - a) / (b - a)


def _at_context(base: dict[int, float], longer: dict[int, dict[int, float]], n: int, context: int | None) -> float:
    """A pass over n tokens after `context` cached ones: linear in the context between the measured
    contexts (CONTEXT for `base`), continued past the last; a pass bigger than a long table's largest
    size takes the base table's cost plus the long table's extra cost at its largest size."""
    here = _interpolate(base, n)
    if context is None or not longer:
        return here
    points = [(CONTEXT, here)]
    for c in sorted(longer):
        tab = longer[c]
        top = max(tab)
        at_c = _interpolate(tab, n) if n <= top else here + _interpolate(tab, top) - _interpolate(base, top)
        points.append((c, at_c))
    if context <= CONTEXT:
        return here
    i = next((i for i in range(1, len(points)) if context <= points[i][0]), len(points) - 1)
    (c0, s0), (c1, s1) = points[i - 1], points[i]
    return max(s0 + (s1 - s0) * (context - c0) / (c1 - c0), here * 0.5)


def _time_pass(lm, context: int, n: int) -> float:
    lm.rollback(context)
    t = time.perf_counter()
    lm.forward([1] * n)
    lm.synchronize()
    return time.perf_counter() - t


def measure(
    lm, sizes, repeats: int = 3, progress=None, budget_s: float = MEASURE_BUDGET_S, context: int = CONTEXT
) -> dict[int, float]:
    """Seconds of one pass over n new tokens after `context` cached ones: the fastest of `repeats`
    rounds (round-robin over the sizes, so a burst of noise does not hit one size only), kept as
    measured (a bigger pass may be cheaper: kernels work in tiles). Every size is timed, in order, until the
    first round would spend more than budget_s / repeats seconds; the sizes past that are not measured
    (extrapolated)."""
    vocab = min(1000, lm.vocab_size)
    text = [(7 * i + 11) % vocab for i in range(context)]
    best: dict[int, float] = {}
    lm.reset()
    lm.forward(text, last_only=True)
    for n in sizes[:2]:  # warm-up
        lm.forward([1] * n)
        lm.rollback(context)
    spent = 0.0
    for r in range(repeats):
        for n in sizes:
            if r and n not in best:
                continue
            if r == 0 and best:  # the next size's cost, guessed in proportion to the last one timed
                last = max(best)
                if spent + best[last] * n / last > budget_s / repeats:
                    break
            seconds = _time_pass(lm, context, n)
            spent += seconds
            best[n] = min(best.get(n, float("inf")), seconds)
            if progress is not None:
                progress.update(1)
    lm.reset()
    return dict(sorted(best.items()))


def within_budget(table: dict[int, float], contexts: list[int], sizes: list[int], budget: float) -> list[int]:
    """The first of these contexts whose tables should take no more than `budget` seconds to time, estimated
    from the base table: reading the context (at the per-token cost of the biggest measured pass), then 3
    rounds of the passes."""
    if not table:
        return []
    big = max(table)
    kept, spent = [], 0.0
    for c in contexts:
        spent += c * table[big] / big + 3 * sum(_interpolate(table, n) for n in sizes)
        if spent > budget:
            break
        kept.append(c)
    return kept


def machine_key(*lms) -> str:
    parts = [platform.machine(), platform.processor(), _cpu_name()] + [lm.describe() for lm in lms]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _tables(raw) -> dict[int, dict[int, float]]:
    return {int(c): {int(k): float(v) for k, v in tab.items()} for c, tab in raw.items()}


def load_or_measure(target_lm, draft_lm=None, progress: bool = True) -> CostModel:
    path = cache_dir() / "costs" / f"{machine_key(*(lm for lm in (target_lm, draft_lm) if lm is not None))}.json"
    if path.exists():
        try:
            raw = json.loads(path.read_text())
            tables = [{int(k): float(v) for k, v in raw[name].items()} for name in ("target", "draft")]
            longer = [_tables(raw.get(name, {})) for name in ("target_at", "draft_at")]
            values = [v for t in tables + [t for d in longer for t in d.values()] for v in t.values()]
            if (
                raw.get("format") == FORMAT
                and tables[0]
                and all(v > 0 for v in values)
                and bool(tables[1]) == (draft_lm is not None)
            ):
                return CostModel(*tables, *longer)
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # a damaged file, or one of an older format: measure again
    from tqdm.auto import tqdm

    sizes = [n for n in TARGET_SIZES if n + CONTEXT < target_lm.max_length]
    dsizes = [k for k in (*DRAFT_SIZES, DRAFT_READ) if draft_lm is not None and k + CONTEXT < draft_lm.max_length]
    longs = [c for c in LONG_CONTEXTS if c + LONG_SIZES < target_lm.max_length]  # room for the long tables' passes
    dlongs = [c for c in LONG_CONTEXTS[:1] if draft_lm is not None and c + 2 * DRAFT_READ < draft_lm.max_length]
    lsizes = [n for n in sizes if n <= LONG_SIZES]
    total = 3 * (len(sizes) + len(dsizes) + len(longs) * len(lsizes) + len(dlongs) * len(dsizes))
    with tqdm(total=total, desc="measuring pass costs (once per machine)", disable=not progress, leave=False) as bar:
        target = measure(target_lm, sizes, progress=bar)
        draft = draft_at = {}
        if dsizes:  # the draft's big pass (catching up) is timed whatever its cost
            draft = measure(draft_lm, dsizes, progress=bar, budget_s=float("inf"))
        lsizes = [n for n in lsizes if n in target]  # what the base table measured (the rest is extrapolated)
        longs, dlongs = (
            within_budget(target, longs, lsizes, LONG_BUDGET_S),
            within_budget(draft, dlongs, dsizes, LONG_BUDGET_S / 2),
        )
        bar.total = 3 * (len(target) + len(draft) + len(longs) * len(lsizes) + len(dlongs) * len(dsizes))
        target_at = {c: measure(target_lm, lsizes, progress=bar, context=c) for c in longs}
        if dsizes:
            draft_at = {c: measure(draft_lm, dsizes, progress=bar, budget_s=float("inf"), context=c) for c in dlongs}
        costs = CostModel(target, draft, target_at, draft_at)
    write_json(
        path,
        {
            "format": FORMAT,
            "target": costs.target,
            "draft": costs.draft,
            "target_at": costs.target_at,
            "draft_at": costs.draft_at,
        },
        indent=1,
    )
    return costs
