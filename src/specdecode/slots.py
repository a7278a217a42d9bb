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
import threading
from types import SimpleNamespace

from .backends import Lockstep, slots as make_slots
from .builders import tree_nodes_cap
from .checks import positive_int
from .engine import Engine
from .errors import SpecDecodeError
from .host import memory_available
from .methods import get_method
from .planning.batch import BatchPricing, CallCostTracker, call_costs, costs_path
from .stats import Generation


class Slots:
    def __init__(
        self,
        engine: Engine,
        n: int,
        cells: int | None = None,
        prefill_chunk: int | None = None,
        context: int | None = None,
    ):
        """n slots sharing a context of `cells` KV entries (default: 4,096 per slot, within the model's context),
        split evenly; or, given `context`, as many as hold that many tokens of prompt and output in each slot beside
        its tree-node ids. A cache bigger than the memory available is refused before it is made. Each slot plans on
        the pass costs of `engine` (measured once per machine) as priced beside the others' (BatchPricing)."""
        positive_int("the number of slots", n)
        if prefill_chunk is not None:
            positive_int("prefill_chunk", prefill_chunk)
        if hasattr(engine, "engines"):  # a routing.Router: its requests run one at a time, each on one engine
            raise SpecDecodeError("--route serves one request at a time; drop --parallel or --route")
        if engine.target.batch_error is not None:  # before any cost measurement
            raise SpecDecodeError(engine.target.batch_error)
        if engine.exact:  # llama.cpp places each token's cell itself: sharing a cache breaks the cell order
            raise SpecDecodeError(
                "exact mode runs one generation at a time: in a cache shared by several generations "
                "llama.cpp may place a token's cell before its earlier ones, and attention then sums "
                "in another order"
            )
        self.engine, self.n = engine, n
        self.lockstep = Lockstep()
        costs = engine.tree_costs()
        cells = slot_cells(engine, n, cells, context)
        targets = make_slots(engine.target, n, cells, self.lockstep, None)
        for t in targets if context is not None else ():  # llama.cpp may round the cells up
            t.max_length = min(t.max_length, context)
        # what whole calls over several generations cost (measured once per machine and slot count, cached): how
        # waiting passes are cut into llama_decode calls, and what a slot's tokens add to a call (BatchPricing)
        self.calls = call_costs(targets[0]._shared, n, costs_path(engine.target, n), engine.progress)
        targets[0]._shared.cost = self.calls.t
        targets[0]._shared.observe = CallCostTracker(self.calls).observe  # kept current by the calls that run
        # one call (see the note at planning.batch.CHUNK_SIZES)
        self.prefill_chunk = prefill_chunk or targets[0].prefill_chunk
        drafts = [None] * n  # the draft's waiting passes: one call each time
        if engine.draft_model is not None:
            drafts = make_slots(engine.draft_model.lm, n, cells, self.lockstep, None)
        self.engines = []
        for target, draft in zip(targets, drafts):
            e = Engine(
                target, copy.deepcopy(engine.tokenizer), draft, draft_window=getattr(engine.draft_model, "window", None)
            )
            e.costs, e.datastore, e.progress = (
                BatchPricing(costs, self._others, self.calls),
                engine.datastore,
                engine.progress,
            )
            e.prompt_cache = engine.prompt_cache  # each slot reuses what its own cache holds
            target.prefill_chunk = self.prefill_chunk
            self.engines.append(e)

    def check_tree(
        self,
        method: str,
        tree_width: int | None = None,
        tree_depth: int | None = None,
        tree_nodes: int | None = None,
        **_,
    ) -> None:
        """InvalidField naming the field where a request's tree shape asks for more tree nodes than a slot's share of
        the ids holds (the Engine's own check, on a slot's models): a server refuses it before answering, as a slot
        would only when it opens the request."""
        if get_method(method).tree_options:
            e = self.engines[0]
            shape = SimpleNamespace(tree_width=tree_width, tree_depth=tree_depth, tree_nodes=tree_nodes)
            tree_nodes_cap(shape, (e.target, e.draft_model.lm if e.draft_model is not None else None))

    def _others(self) -> int:
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
            raise SpecDecodeError(
                f"a slot's context must be 1..{engine.target.max_length} tokens (the model's), got {context!r}"
            )
        cells = n * (context + node_ids(n))
    cells = cells or n * min(4096, engine.target.max_length)
    lms = [engine.target] + ([engine.draft_model.lm] if engine.draft_model is not None else [])
    need = sum(cells * lm.kv_cell_bytes() for lm in lms if hasattr(lm, "kv_cell_bytes"))
    free = memory_available()
    if free is not None and need > free:
        raise SpecDecodeError(
            f"{n} slots of {cells // n} cache cells need {need / 2**30:.1f} GiB for keys and "
            f"values, more than the {free / 2**30:.1f} GiB available: fewer slots or a smaller "
            "context (--parallel, --ctx-size)"
        )
    return cells
