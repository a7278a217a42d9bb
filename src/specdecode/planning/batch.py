"""What a generation's pass costs in a batch (continuous batching, slots.py): the measured table of whole calls over
several generations (call_costs), kept current by the calls that run (CallCostTracker), and a generation's price for
n tokens beside the others' (BatchPricing), which each slot's planner reads. The measurements behind these rules are
in docs/serving/batching.md ("Speculation in company")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..backends import time_mixing
from ..host import cache_dir, write_json
from .costs import CostModel, machine_key

# tokens in one call over several generations (time_calls): every size to 16, where kernels change (a few points
# alone misprice the sizes between them: docs/results/notes.md#code-call-sizes), then a few
CALL_SIZES = tuple(range(1, 17)) + (20, 24)
CHUNK_SIZES = (32, 64, 128, 256)  # and the calls a prompt's chunk makes beside the others' decoding (plan_split's cuts)
# A prompt's chunk beside decoding generations: a slot's default, N_BATCH tokens (one llama_decode call), the others'
# steps between the calls. Bigger calls read a prompt faster per token, and at long contexts the others' steps go in
# a call of their own (split.mixing), which each chunk adds: 512-token chunks gave served prompts' first tokens
# sooner than 128-token ones at the same throughput (measured: docs/results/notes.md#code-call-sizes).
# `serve --prefill-chunk` / Slots(prefill_chunk=) trade first tokens for steadier steps.
CALLS_FORMAT = 3  # the cached table's format: 2, measured with every pass on the compute thread (1 was up to 25% slow),
# every size to 16; 3: with what a tiled call spends per cell of another generation it mixes in ("per_cell")


def costs_path(lm, n: int) -> Path:
    """Where the table of whole calls over n slots of `lm` is cached (one per machine and slot count)."""
    return cache_dir() / "costs" / f"calls-{machine_key(lm)}-{n}.json"


def call_costs(shared, n: int, path: Path, progress: bool = True) -> CostModel:
    """The target's table of whole calls over n slots (SharedContext.time_calls), read from `path` or
    measured there (a few seconds: each slot reads 128 tokens first, one slot 1,024 more for split.time_mixing); sets
    `shared.per_cell` (time_mixing) from the same file."""
    room = shared.slots[0].max_length - 128  # time_calls: 128 tokens in each slot first
    sizes = [m for m in CALL_SIZES if m <= max(4 * n, 8)] + [m for m in CHUNK_SIZES if n <= m - n < room]
    try:
        raw = json.loads(path.read_text())
        table = {int(k): float(v) for k, v in raw["calls"].items()}
        if raw.get("format") == CALLS_FORMAT and set(sizes) <= set(table) and all(v > 0 for v in table.values()):
            shared.per_cell = max(0.0, float(raw["per_cell"]))
            return CostModel(table)
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        pass  # none yet, damaged, or of an older format: measure
    if progress:
        sys.stderr.write(f"measuring batched pass costs for {n} slots (once per machine)...\n")
    table = shared.time_calls(sizes, chunk_from=min(CHUNK_SIZES))
    shared.per_cell = time_mixing(shared)
    write_json(path, {"format": CALLS_FORMAT, "calls": table, "per_cell": shared.per_cell})
    return CostModel(table)


LEARN_RATE = 0.25  # weight of each observed call in its size's running cost
LEARN_EVERY = 64  # observed calls between updates of the table the planners read (each re-prices their cuts)


class CallCostTracker:
    """The measured table of whole calls, kept current by the calls that run: each decoding size's cost moves toward
    what its calls take (a running average), written into the table every LEARN_EVERY calls. The table was timed
    with 128 tokens in each slot; served slots hold longer texts, whose calls cost more (enough to make `auto` run
    below plain decoding: docs/results/notes.md#code-call-sizes). Prompts' chunk sizes (above the decoding sizes)
    stay as timed."""

    def __init__(self, calls: CostModel, top: int = max(CALL_SIZES)):
        self.calls, self.top = calls, top
        self.running: dict[int, float] = {}
        self.seen = 0

    def observe(self, m: int, seconds: float) -> None:
        """A call of m tokens took `seconds` (SharedContext.decode, one call at a time)."""
        before = self.running.get(m, self.calls.target.get(m))
        if m > self.top or before is None:
            return
        self.running[m] = before + LEARN_RATE * (seconds - before)
        self.seen += 1
        if self.seen % LEARN_EVERY == 0:
            self.calls.target.update(self.running)
            self.calls.version += 1  # BatchPricing re-cuts on the new costs


class BatchPricing(CostModel):
    """A generation's pass costs in a batch: with b other generations in the call, n tokens cost the dearer of
    C(B n) / B, B = b + 1 (its share of a call where every generation does as it does) and C(B) / B + C(b + n) -
    C(B) (what it adds to the others' plain steps), C the cheapest cut of that many tokens into whole calls as
    measured (`calls`; without it, one generation's table). The draft's passes keep their cost alone. Where a
    bigger pass costs about another plain step, speculation shrinks or stops as the batch grows."""

    static = False  # at() depends on the others of the moment

    def __init__(self, base: CostModel, others, calls: CostModel | None = None):
        super().__init__(base.target, base.draft, base.target_at, base.draft_at)
        self.others = others  # () -> tokens the other live generations put into a pass
        self.calls = calls
        self._memo: dict[int, float] = {}  # the cheapest cut of m tokens into measured calls (_cut)
        self._version = 0  # of the calls' table the memo was cut on

    def at(self, context: int, draft_context: int | None = None) -> CostModel:
        now, b = super().at(context, draft_context), self.others()
        if b <= 0:
            return now
        cut = self._cut(now)
        floor = 0.05 * now.t(1)  # a pass is never free
        # the draft's passes at their cost alone: the others' tokens are in the target's call, not the draft's
        # (which runs while they wait; priced as a share of others' draft calls, the draft looked cheaper beside
        # other generations than alone, and auto ran it where it did not pay).
        # n tokens: the dearer of two prices, so that a guess pays whatever the others do. (1) Its share of a call
        # where every live generation does as this one, C(B n) / B, B = b + 1: each slot plans alone, so pricing
        # only what a guess adds let every slot add one at once. (2) What it adds to the others' plain steps,
        # C(b + n) - C(b + 1), over its plain share: where a call of every slot's guesses would reach a cheaper
        # kernel but one slot's guesses alone do not. Each price alone made auto slower than plain decoding
        # (measured: docs/results/notes.md#code-batch-price). C: the cheapest cut of that many tokens into calls.
        live = b + 1
        plain = cut(live) / live

        def price(n: int) -> float:
            return max(floor, cut(live * n) / live, plain + cut(b + n) - cut(live))

        return CostModel({n: price(n) for n in now.target}, now.draft)

    def _cut(self, now: CostModel):
        """m -> seconds of m tokens in the cheapest cut into whole calls (as Lockstep's plan_split cuts the waiting
        passes; tokens taken as divisible), on the measured calls (without them, one generation's table now)."""
        whole = self.calls or now
        memo = self._memo if self.calls is not None else {}
        if whole.version != self._version:  # the calls' table learned (CallCostTracker): cut on its new costs
            memo.clear()
            self._version = whole.version

        def cut(m: int) -> float:
            for k in range(len(memo) + 1, m + 1):  # memo holds 1 .. len(memo)
                memo[k] = min([whole.t(k)] + [memo[i] + memo[k - i] for i in range(1, k // 2 + 1)])
            return memo[m] if m > 0 else 0.0

        return cut
