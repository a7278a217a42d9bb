"""Continuous batching: `Slots(engine, n)` makes n Engines on one loaded Engine's weights whose generations,
each on its own thread, share every target (and draft) pass: one llama_decode carries each live generation's
root token and guesses (backends/batching.py). Generations join and leave between steps; a prompt is read in
chunks while others are decoding, so that it does not freeze them.

    >>> slots = Slots(Engine.load(), 4)
    >>> outs = slots.generate_many(["def fib(n):", "def add(a, b):"], method="auto", max_new_tokens=64)

Each slot is an ordinary Engine (`slots.engines[i]`): run a generation on it inside `slots.generation()` from
its own thread, one generation per slot at a time. Each request's output law is that of the target alone: a
slot's logits read only its own cache cells (its own sequence ids). The kernels llama.cpp picks depend on the
size of the whole pass, so greedy output can differ from a generation alone at near-ties, as it can between
pass sizes; exact mode runs one generation at a time (Slots refuses an exact Engine).
"""
from __future__ import annotations

import copy
import json
import sys
import threading
from pathlib import Path

from .backends import cache_dir, slots as make_slots
from .backends import Lockstep
from .backends import time_mixing
from .engine import Engine
from .errors import SpecDecodeError
from .host import write_json
from .planning.costs import CostModel
from .routing import memory_available
from .stats import Generation


class Slots:
    def __init__(self, engine: Engine, n: int, cells: int | None = None, prefill_chunk: int | None = None,
                 context: int | None = None):
        """n slots sharing a context of `cells` KV entries (default: 4,096 per slot, within the model's context),
        split evenly; or, given `context`, as many as hold that many tokens of prompt and output in each slot beside
        its tree-node ids. A cache bigger than the memory available is refused before it is made. The pass costs of `engine` (measured once per machine) are what each slot plans on, as
        costs in company (InCompany)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise SpecDecodeError(f"the number of slots must be a positive integer, got {n!r}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise SpecDecodeError(f"prefill_chunk must be a positive number of tokens, got {prefill_chunk!r}")
        if hasattr(engine, "engines"):  # a routing.Router: its requests run one at a time, each on one engine
            raise SpecDecodeError("--route serves one request at a time; drop --parallel or --route")
        if engine.target.batch_error is not None:  # before any cost measurement
            raise SpecDecodeError(engine.target.batch_error)
        if engine.exact:  # llama.cpp places each token's cell itself: sharing a cache breaks the cell order
            raise SpecDecodeError("exact mode runs one generation at a time: in a cache shared by several generations "
                                  "llama.cpp may place a token's cell before its earlier ones, and attention then sums "
                                  "in another order")
        self.engine, self.n = engine, n
        self.lockstep = Lockstep()
        costs = engine.tree_costs()
        cells = slot_cells(engine, n, cells, context)
        targets = make_slots(engine.target, n, cells, self.lockstep, None)
        for t in targets if context is not None else ():  # llama.cpp may round the cells up
            t.max_length = min(t.max_length, context)
        # what whole calls over several generations cost (measured once per machine and slot count, cached): how
        # waiting passes are cut into llama_decode calls, and what a slot's tokens add to a call (InCompany)
        self.calls = call_costs(targets[0]._shared, n, costs_path(engine.target, n), engine.progress)
        targets[0]._shared.cost = self.calls.t
        targets[0]._shared.observe = LearnedCalls(self.calls).observe  # kept current by the calls that run
        self.prefill_chunk = prefill_chunk or targets[0].prefill_chunk  # one call (see the note at CHUNK_SIZES)
        drafts = [None] * n  # the draft's waiting passes: one call each time
        if engine.draft_model is not None:
            drafts = make_slots(engine.draft_model.lm, n, cells, self.lockstep, None)
        self.engines = []
        for target, draft in zip(targets, drafts):
            e = Engine(target, copy.deepcopy(engine.tokenizer), draft, draft_window=getattr(engine.draft_model,
                       "window", None))
            e.costs, e.datastore, e.progress = InCompany(costs, self._company, self.calls), engine.datastore, \
                engine.progress
            e.prompt_cache = engine.prompt_cache  # each slot reuses what its own cache holds
            target.prefill_chunk = self.prefill_chunk
            self.engines.append(e)

    def _company(self) -> int:
        """Tokens the other live generations put into a pass (one each, at least)."""
        return max(0, self.lockstep.live - 1)

    def generation(self):
        """Mark the calling thread's generation as live while it runs (its passes then wait for the others')."""
        return self.lockstep.generation()

    def run(self, i: int, prompt, **kwargs) -> Generation:
        """Generate on slot i from the calling thread (a live generation while it runs)."""
        with self.generation():
            return self.engines[i].generate(prompt, **kwargs)

    def generate_many(self, prompts: list, **kwargs) -> list[Generation]:
        """Generate every prompt, up to n at a time, each on a slot of its own; results in the prompts' order.
        The first error raised by a generation is raised here after the others end."""
        results: list = [None] * len(prompts)
        todo = list(range(len(prompts)))[::-1]
        lock = threading.Lock()
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            while True:
                with lock:
                    if not todo or errors:
                        return
                    k = todo.pop()
                try:
                    results[k] = self.run(i, prompts[k], **kwargs)
                except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
                    with lock:
                        errors.append(e)
        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(min(self.n, len(prompts)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def slot_cells(engine: Engine, n: int, cells: int | None, context: int | None) -> int:
    """The cells of n slots' shared context (see Slots), checked against the memory available for their keys and values
    (the target's and the draft's)."""
    from .backends import node_ids
    if context is not None:
        if isinstance(context, bool) or not isinstance(context, int) or not 1 <= context <= engine.target.max_length:
            raise SpecDecodeError(f"a slot's context must be 1..{engine.target.max_length} tokens (the model's), "
                                  f"got {context!r}")
        cells = n * (context + node_ids(n))
    cells = cells or n * min(4096, engine.target.max_length)
    lms = [engine.target] + ([engine.draft_model.lm] if engine.draft_model is not None else [])
    need = sum(cells * lm.kv_cell_bytes() for lm in lms if hasattr(lm, "kv_cell_bytes"))
    free = memory_available()
    if free is not None and need > free:
        raise SpecDecodeError(f"{n} slots of {cells // n} cache cells need {need / 2 ** 30:.1f} GiB for keys and "
                              f"values, more than the {free / 2 ** 30:.1f} GiB available: fewer slots or a smaller "
                              "context (--parallel, --ctx-size)")
    return cells


# tokens in one call over several generations (time_calls): every size to 16, where kernels change (on a Zen 4 over 8
# slots, ms: 8: 226, 12: 279, 14: 331, 16: 280; the 8/12/16 points alone priced a 14-token call at 268), then a few
CALL_SIZES = tuple(range(1, 17)) + (20, 24)
CHUNK_SIZES = (32, 64, 128, 256)  # and the calls a prompt's chunk makes beside the others' decoding (plan_split's cuts)
# A prompt's chunk beside decoding generations: a slot's default, N_BATCH tokens (one llama_decode call), the others'
# steps between the calls. Bigger calls read a prompt faster per token, and at long contexts the others' steps go in
# a call of their own (split.mixing), which each chunk adds. Measured, Xeon, 4 slots, 12 chat prompts of 617-1,914
# tokens served 4 at a time (README, runs 30-31): chunks of 128 (the smallest call within 10% of the cheapest per
# token at 128 cells, the rule before), first tokens p99 44.9 s, llama-server 29.5; chunks of 512, 27.4 s at the same
# throughput, the others' steps p99 6.9 s apart (llama-server's 11.7: it reads up to 2,048 prompt tokens between two
# steps). `serve --prefill-chunk` / Slots(prefill_chunk=) trade first tokens for steadier steps.
CALLS_FORMAT = 3  # the cached table's format: 2, measured with every pass on the compute thread (1 was up to 25% slow),
# every size to 16; 3: with what a tiled call spends per cell of another generation it mixes in ("per_cell")


def costs_path(lm, n: int) -> Path:
    from .planning.costs import machine_key
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


class LearnedCalls:
    """The measured table of whole calls, kept current by the calls that run: each decoding size's cost moves toward
    what its calls take (a running average), written into the table every LEARN_EVERY calls. The table was timed with
    128 tokens in each slot, the fastest of 3 rounds; a served load's slots hold longer texts (attention grows with
    them). Measured on a Xeon (8 slots, MT-bench chat, 128 new tokens): calls of 9-11 tokens took 228-260 ms where the
    table said 218-248, so a lookup guess beside 8 plain rows (210 ms) was priced at 7.5 ms instead of ~20, and `auto`
    in company ran 4% below plain decoding; with those sizes at what they took, 1-3%. Sizes of prompts' chunks (above
    the decoding sizes) are left as measured."""

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
            self.calls.version += 1  # InCompany re-cuts on the new costs


class InCompany(CostModel):
    """What a generation's pass costs in a shared one: with b other generations in it, n tokens cost the dearer of
    C(B n) / B, B = b + 1 (its share of a call where every generation does as it does) and C(B) / B + C(b + n) -
    C(B) (what it adds to the others' plain steps), C the cheapest cut of that many tokens into whole calls over
    several generations as measured (`calls`; without it, one generation's table T; the draft's passes: its own
    table). The planner, reading these, weighs a guess against a plain step at their cost in company: where a
    bigger pass costs about as much per token as another plain step (compute-bound kernels) or jumps to a
    slower kernel, speculation shrinks or stops as the batch grows; where a pass is flat in its size
    (memory-bound), guesses stay cheap."""

    static = False  # at() depends on the company of the moment

    def __init__(self, base: CostModel, company, calls: CostModel | None = None):
        super().__init__(base.target, base.draft, base.target_at, base.draft_at)
        self.company = company  # () -> tokens of the other generations in a pass
        self.calls = calls
        self._memo: dict[int, float] = {}  # the cheapest cut of m tokens into measured calls (_cut)
        self._version = 0  # of the calls' table the memo was cut on

    def at(self, context: int, draft_context: int | None = None) -> CostModel:
        now, b = super().at(context, draft_context), self.company()
        if b <= 0:
            return now
        cut = self._cut(now)
        floor = 0.05 * now.t(1)  # a pass is never free
        # the draft's passes at their cost alone: the others' tokens are in the target's call, not the draft's
        # (which runs while they wait; priced as a share of others' draft calls, the 0.5B on a Zen 4 looked 2.6x
        # cheaper in company of 8 than alone, and auto ran it there: 13-15 tok/s offline against 22 plain).
        # n tokens: the dearer of two prices, so that a guess pays whatever the others do. (1) Its share of a call
        # where every live generation does as this one, C(B n) / B, B = b + 1: each slot plans alone, so pricing
        # only what a guess adds let every slot add one at once (Xeon, 4 slots: auto 24.6-25.2 tok/s against
        # 25.8-26.4 plain, where C(4) < C(3) made a guess look free). (2) What it adds to the others' plain
        # steps, C(b + n) - C(b + 1), over its plain share: where a call of every slot's guesses would reach a
        # cheaper kernel but one slot's guesses alone do not (Zen 4, 8 slots: C(16) < C(12), so a guess looked
        # nearly free as a share, while the real calls of 10-14 tokens cost 1.3-1.6x the 8 plain rows; auto
        # 23.7-25.0 tok/s against 26.5-28.5 plain). C: the cheapest cut of that many tokens into calls.
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
        if whole.version != self._version:  # the calls' table learned (LearnedCalls): cut on its new costs
            memo.clear()
            self._version = whole.version

        def cut(m: int) -> float:
            for k in range(len(memo) + 1, m + 1):  # memo holds 1 .. len(memo)
                memo[k] = min([whole.t(k)] + [memo[i] + memo[k - i] for i in range(1, k // 2 + 1)])
            return memo[m] if m > 0 else 0.0
        return cut
