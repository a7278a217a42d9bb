"""Continuous batching on llama.cpp: several generations, each on its own thread with its own LM (a slot),
share one llama.cpp context, and their passes run together in one `llama_decode`.

- SharedContext: a second context on a loaded LlamaLM's weights, with room for every slot (one unified KV
  buffer); its cells are split evenly between the slots, and so are the sequence ids (each slot: one trunk id,
  in exact mode a parking id, and its share of the tree-node ids). Sequence ids keep the slots apart: a query
  sees only the cells of its own sequence, so a slot's logits are those of a generation alone, up to the
  kernel paths the pass size selects (exact mode: see Lockstep's max_pass).
- LlamaSlot: an LlamaLM (the same bookkeeping: trunk, tree, rollback) on its slot's ids; its passes go
  through the Lockstep instead of llama_decode.
- Lockstep: a pass waits until every live generation waits for a pass (or the guard time passed), then the
  waiting passes of one context run together, split into several llama_decode calls where the measured cost
  of whole passes says that is cheaper (a pass size whose kernel is slow per token is avoided).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable

import numpy as np

from ...errors import EngineUnavailable, SpecDecodeError
from .. import compute
from ..base import common_start
from .lm import MAX_SEQ, N_BATCH, LlamaLM
from .split import plan_split

GUARD_S = 0.02  # a pass waits at most this long for live generations that have not asked for theirs yet


class Lockstep:
    """Runs the passes of several threads together. `generation()` marks a thread's generation as live while
    it runs: a pass then waits for the other live generations' passes (they come within the Python work of a
    step: verifying, drafting from a lookup, detokenizing) and all run in one go."""

    def __init__(self, guard_s: float = GUARD_S):
        self.guard_s = guard_s
        self._cv = threading.Condition()
        self._live = 0
        self._reading = 0  # generations reading a prompt
        self._mine = threading.local()  # the calling thread's: .live (generations), .reading (a prompt)
        self._waiting = 0
        self._busy = False
        self._queues: dict[SharedContext, list] = {}
        self.passes = 0  # llama_decode calls made
        self.rows = 0  # requests (one slot's pass each) they carried

    @property
    def live(self) -> int:
        return self._live

    def others_decoding(self) -> int:
        """Live generations other than the calling thread's that are not reading a prompt now (they wait for
        the caller's passes)."""
        mine = self._mine
        return self._live - self._reading - (getattr(mine, "live", 0) > 0 and not getattr(mine, "reading", False))

    @contextmanager
    def reading_prompt(self):
        """Marks the calling thread's live generation as reading a prompt while it runs."""
        before = getattr(self._mine, "reading", False)
        counted = getattr(self._mine, "live", 0) > 0 and not before
        with self._cv:
            self._reading += counted
        self._mine.reading = True
        try:
            yield
        finally:
            self._mine.reading = before
            with self._cv:
                self._reading -= counted

    @contextmanager
    def generation(self):
        with self._cv:
            self._live += 1
        self._mine.live = getattr(self._mine, "live", 0) + 1
        try:
            yield
        finally:
            self._mine.live -= 1
            with self._cv:
                self._live -= 1
                self._cv.notify_all()

    def run(self, shared: "SharedContext", tokens: list) -> np.ndarray | None:
        """One slot's pass (tokens as LlamaLM._decode takes them), run together with the others'."""
        req = [tokens, None, None, threading.get_ident()]  # tokens, logits rows, error; whose
        with self._cv:
            self._queues.setdefault(shared, []).append(req)
            self._waiting += 1
            self._cv.notify_all()
            deadline = time.monotonic() + self.guard_s
            while req[1] is None and req[2] is None:
                now = time.monotonic()
                if not self._busy and (self._waiting >= self._live or now >= deadline):
                    ctx = max(self._queues, key=lambda c: len(self._queues[c]))
                    batch = self._queues.pop(ctx)
                    self._busy = True
                    self._cv.release()
                    handed, taken = [0], list(batch)  # passes handed back as their call ended (done); all run

                    def done(part: list) -> None:
                        with self._cv:
                            self._waiting -= len(part)
                            handed[0] += len(part)
                            self._cv.notify_all()

                    def more() -> list:  # passes asked for while this round's calls run join it, one per
                        with self._cv:  # generation a round (a decoding one's steps never starve a prompt's chunk)
                            late, seen = self._queues.pop(ctx, []), {r[3] for r in taken}
                            join = [r for r in late if r[3] not in seen]
                            if len(join) < len(late):
                                self._queues[ctx] = [r for r in late if r[3] in seen]
                        taken.extend(join)
                        return join

                    try:
                        self.passes += ctx.decode(batch, done, more)
                        self.rows += len(taken)
                    except BaseException as e:  # noqa: BLE001 (each thread raises its own request's error)
                        for r in taken:
                            if r[1] is None and r[2] is None:
                                r[2] = e
                    finally:
                        self._cv.acquire()
                        self._busy = False
                        self._waiting -= len(taken) - handed[0]
                        self._cv.notify_all()
                    deadline = time.monotonic() + self.guard_s
                else:
                    self._cv.wait(max(1e-4, deadline - now) if not self._busy else None)
        if req[2] is not None:
            raise req[2]
        return req[1]


class _Locked:
    """llama_cpp's bindings with every call on the shared context's memory (sequence copies and removals, made
    by a slot's own thread) under the context's lock, which a llama_decode holds too: llama.cpp's calls on one
    context must not overlap."""

    def __init__(self, lc, lock: threading.Lock):
        self._lc, self._lock = lc, lock

    def __getattr__(self, name: str):
        f = getattr(self._lc, name)
        if not name.startswith("llama_memory_"):
            return f

        def locked(*args):
            with self._lock:
                return f(*args)

        return locked


def node_ids(slots: int, exact: bool = False) -> int:
    """Tree-node sequence ids each of `slots` slots holds: the context's MAX_SEQ ids less each slot's trunk (and in
    exact mode its parking id), shared evenly."""
    return (MAX_SEQ - slots * (2 if exact else 1)) // max(1, slots)


class SharedContext:
    """One llama.cpp context on `lm`'s weights that `slots` slots share (see the module's doc)."""

    def __init__(self, lm: LlamaLM, slots: int, cells: int, lockstep: Lockstep, cost=None):
        lc = self._lc = lm._lc
        park = 1 if lm.exact else 0
        per = node_ids(slots, lm.exact)
        if slots < 1 or per < 1:
            raise SpecDecodeError(
                f"a llama.cpp context holds {MAX_SEQ} sequences: at most {MAX_SEQ // (2 + park)} slots, not {slots}"
            )
        self.lm, self.lockstep, self.cost = lm, lockstep, cost
        self.per_cell = 0.0  # seconds a tiled call mixing generations spends per cell of the others (split.time_mixing)
        # told each call's size and seconds (planning.batch.CallCostTracker)
        self.observe: Callable[[int, float], None] | None = None
        self.lock = threading.Lock()  # one llama.cpp call on this context at a time
        self.prefix_lock = threading.RLock()  # slots sharing their text (LlamaSlot.keep_prefix); taken before .lock
        cparams = type(lm._cparams).from_buffer_copy(lm._cparams)
        cparams.n_ctx = max(cells, N_BATCH)
        # flash attention: its kernel skips the cells a query does not see, while plain attention multiplies every
        # query by every cell of every slot (measured: docs/results/notes.md#code-shared-flash-attention)
        cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = lc.llama_init_from_model(lm._model, cparams)
        if not self.ctx:
            raise EngineUnavailable(
                f"llama.cpp could not create a context of {cells} cells for {slots} slots (memory?)"
            )
        self.mem = lc.llama_get_memory(self.ctx)
        self.cells = int(lc.llama_n_ctx(self.ctx))
        self._batch = lc.llama_batch_init(N_BATCH, 0, MAX_SEQ)
        ids = list(range(MAX_SEQ))
        self.slots = []
        for s in range(slots):
            own, ids = ids[: 1 + park + per], ids[1 + park + per :]
            self.slots.append(LlamaSlot(self, own[0], own[1] if park else None, own[1 + park :], self.cells // slots))

    def time_calls(self, sizes, context: int = 128, repeats: int = 3, chunk_from: int = 32) -> dict[int, float]:
        """Seconds of one llama_decode call over m tokens, every slot `context` tokens in: the cost of the whole calls
        batching decides by (one generation's table overstates them: docs/results/notes.md#code-whole-calls). Below
        `chunk_from` the tokens are spread over the slots round robin, logits for each (m = 6 over 4 slots: 2, 2, 1, 1
        tokens); from it, as the calls a prompt makes while others decode: one slot's chunk of
        m - (slots - 1) tokens (logits for its last) and one token of each other slot. The fastest of `repeats`
        rounds. Run it while no generation is live (it uses every slot)."""
        vocab = min(1000, self.lm.vocab_size)
        text = [(7 * i + 11) % vocab for i in range(context)]
        for slot in self.slots:
            slot.reset()
            slot.forward(text, last_only=True)
        n, best = len(self.slots), {}
        for _ in range(repeats):
            for m in sizes:
                per = [m // n + (i < m % n) for i in range(n)] if m < chunk_from else [m - n + 1] + [1] * (n - 1)
                tokens = [
                    (1, context + k, [slot.seq0], m < chunk_from or k == c - 1)
                    for slot, c in zip(self.slots, per)
                    for k in range(c)
                ]
                t = time.perf_counter()
                self._decode(tokens)
                best[m] = min(best.get(m, float("inf")), time.perf_counter() - t)
                for slot in self.slots:
                    self._lc.llama_memory_seq_rm(self.mem, slot.seq0, context, -1)
        for slot in self.slots:
            slot.reset()
        return dict(sorted(best.items()))

    def decode(
        self, batch: list, done: Callable[[list], None] | None = None, more: Callable[[], list] | None = None
    ) -> int:
        """Run the waiting passes (requests [tokens, rows, error], filled in here); returns the calls made. The
        shortest passes go first (one-token steps before prompts' chunks, short prompts before long ones), and
        `done(part)` hands each call's passes back as soon as it ends: a short prompt's first token does not wait
        for a long prompt read in the same step. After each call, `more()` gives the passes asked for meanwhile (a
        generation's next step, a cached prompt's one token): they go before the longer passes still waiting,
        instead of after all of this round's calls (measured: docs/results/notes.md#code-short-first)."""
        calls, todo = 0, sorted(batch, key=lambda r: len(r[0]))
        while todo:
            g = plan_split(
                [len(r[0]) for r in todo],
                self.cost,
                cells=[1 + max(t[1] for t in r[0]) for r in todo],
                in_use=sum(len(s.ids) for s in self.slots),
                per_cell=self.per_cell,
            )[0]
            part, todo = todo[:g], todo[g:]
            calls += 1
            try:
                tokens, t0 = [t for r in part for t in r[0]], time.perf_counter()
                rows = self._decode(tokens)
                if self.observe is not None:
                    self.observe(len(tokens), time.perf_counter() - t0)
                k = 0
                for r in part:
                    n = sum(1 for t in r[0] if t[3])
                    r[1] = rows[k : k + n] if n else np.zeros((0, self.lm.vocab_size), np.float32)
                    k += n
            except Exception as e:  # every pass of the failed call fails, the others go on
                for r in part:
                    r[2] = e
            if done is not None:
                done(part)
            if more is not None and todo:
                todo = sorted(todo + more(), key=lambda r: len(r[0]))
        return calls

    def _decode(self, tokens: list) -> np.ndarray:
        lc, batch = self._lc, self._batch
        for i, (tok, p, seqs, want) in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, p, len(seqs), want
            for k, s in enumerate(seqs):
                batch.seq_id[i][k] = s
        batch.n_tokens = len(tokens)
        n_out = sum(1 for t in tokens if t[3])
        with self.lock:
            rc = compute.call(lc.llama_decode, self.ctx, batch)
            if rc != 0:
                raise EngineUnavailable(
                    f"llama_decode failed with status {rc} ({len(tokens)} tokens of a batched "
                    f"pass; {self.cells} cells shared by {len(self.slots)} slots)"
                )
            if not n_out:
                return np.zeros((0, self.lm.vocab_size), np.float32)
            return np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(n_out, self.lm.vocab_size)).copy()

    def __del__(self):
        lc = getattr(self, "_lc", None)
        if lc is not None and getattr(self, "_batch", None) is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if lc is not None and getattr(self, "ctx", None):
            lc.llama_free(self.ctx)
            self.ctx = None


class LlamaSlot(LlamaLM):
    """One slot of a SharedContext: LlamaLM's bookkeeping on the slot's own sequence ids and share of cells."""

    def __init__(self, shared: SharedContext, seq0: int, park: int | None, node_ids: list[int], cells: int):
        lm = shared.lm
        for name in (
            "_lc",
            "path",
            "exact",
            "repack",
            "_model",
            "_vocab",
            "vocab_size",
            "threads",
            "_cparams",
            "device",
            "dtype",
            "name",
            "eos_token_ids",
            "eog_ids",
            "n_params",
            "quant_info",
        ):
            setattr(self, name, getattr(lm, name))
        self._lc = _Locked(lm._lc, shared.lock)
        self._shared, self._ctx, self._mem, self._cells = shared, shared.ctx, shared.mem, cells
        self.seq0, self.park, self._node_ids = seq0, park, list(node_ids)
        self.max_tree_nodes = len(node_ids)
        self.max_length = min(lm.max_length, cells - len(node_ids))
        self._batch = None
        self.ids, self.seq = [], []
        self._free = list(self._node_ids)  # before the first reset: every node id is free
        self._held = (None, 0)  # (scope, n): entries [0, n) stay in this slot's cache until it lowers n (prefix_lock)
        self.reset()

    prefill_chunk = N_BATCH  # tokens per pass of a causal feed while other generations decode

    def feed_step(self, left: int) -> int:
        """A prompt is read whole (N_BATCH a pass) while no other generation decodes, as llama-server reads it: nobody
        waits for it, and big calls read fastest per token. Beside decoding generations, in chunks of prefill_chunk
        (their next step waits for one chunk); a rest of at most half a chunk more goes with the chunk before it
        (a small call reads slowly per token and costs the others a step of its own)."""
        if self._shared.lockstep.others_decoding() <= 0:
            return min(left, N_BATCH)
        step = self.prefill_chunk
        return min(left if 2 * left <= 3 * step else step, N_BATCH)

    def reading_prompt(self):
        return self._shared.lockstep.reading_prompt()

    def describe(self) -> str:
        return self._shared.lm.describe()

    def reserve(self, n: int) -> None:
        pass  # a slot's cells are set aside up front (max_length: the loop stops there, as LlamaLM's does)

    def keep_prefix(self, ids: list[int], scope: str | None) -> int:
        """LM.keep_prefix, where the longest start of `ids` that any slot of the context holds for `scope` counts:
        another slot's is copied into this slot's sequence (in a unified cache a copy adds this slot's id to the
        cells: no pass, no new cell). A wave of prompts that share a system prompt reads it once; a conversation's
        next turn finds its text whichever slot serves it. Another slot's entries are shared only below its `_held`
        mark: a slot lowers the mark (under prefix_lock) before it drops an entry below it."""
        with self._shared.prefix_lock:
            self._held = (None, 0)
            own, src, most = self.cached_prefix(ids, scope), None, 0
            for s in self._shared.slots:
                n = s.shareable(ids, scope) if s is not self else 0
                if n > most:
                    src, most = s, n
            if most > own:
                self.reset()
                self._lc.llama_memory_seq_cp(self._mem, src.seq0, self.seq0, 0, most)
                self.ids, self.trunk = list(ids[:most]), most
            else:
                most = super().keep_prefix(ids, scope)
            self._held = (scope, most)
            return most

    def shareable(self, ids: list[int], scope: str | None) -> int:
        """How much of `ids` (but its last token) this slot's held entries give a slot of the same scope
        (prefix_lock held)."""
        held, n = self._held
        if held is None or held != scope:
            return 0
        return common_start(self.ids, ids, min(n, len(ids) - 1))

    def release(self) -> None:
        with self._shared.prefix_lock:  # the generation ended: its committed text may be shared
            self._held = (self.owner, self.trunk) if self.owner is not None else (None, 0)

    def rollback(self, length: int, path: list[int] = ()) -> None:
        if length < self._held[1]:
            with self._shared.prefix_lock:
                self._held = (self._held[0], length)
        super().rollback(length, path)

    def reset(self) -> None:
        with self._shared.prefix_lock:
            self._held = (None, 0)
        lc = self._lc
        free = set(self._free)
        taken = [sid for sid in self._node_ids if sid not in free]  # ids in use, or taken by a pass that failed
        for sid in (self.seq0, *taken, *((self.park,) if self.park is not None else ())):
            lc.llama_memory_seq_rm(self._mem, sid, -1, -1)
        self.ids, self.trunk, self.parent, self.pos, self.seq = [], 0, [], [], []
        self._free = self._node_ids[::-1]
        self.parked = 0

    def _decode(self, tokens):
        return self._shared.lockstep.run(self._shared, tokens)

    def synchronize(self) -> None:
        pass  # a pass has ended when Lockstep.run returns

    def __del__(self):
        pass  # the SharedContext owns the context, the loaded LlamaLM the weights
