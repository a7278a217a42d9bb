"""The shared llama.cpp context's cache edits (sequence copies and removals) made by the slots' own threads.

llama.cpp's calls on one context must not overlap, so every edit runs under the context's lock, which each
llama_decode holds too. An edit asked for while a call runs does not wait for it: it is queued and applied, in
the order asked, under the lock before anything else touches the context (the next call, or the next edit made
at once). A generation that joins while the others' pass runs (its slot reset, a prompt's start copied from
another slot) is then ready for the next call instead of a call later: measured on a Xeon, 4 prompts arriving
together behind a cached one's 1-token call were read in two calls after it, the later two waiting ~2 s on the
lock, where llama-server reads them in one call.

Why the order holds: edits that depend on each other are ordered by the caller's own locks (a slot's thread makes
its own edits in turn; a prompt's start copied from another slot is queued under the slots' prefix lock, which the
other slot takes before it removes those entries), and a queued edit is applied before any edit made after it
under the lock. Removal can fail only on recurrent or hybrid memory (a partial removal there): on such models
nothing is queued.
"""
from __future__ import annotations

import threading

QUEUED = frozenset({"llama_memory_seq_rm", "llama_memory_seq_cp", "llama_memory_seq_keep", "llama_memory_seq_add"})


class MemoryOps:
    """The lock of one llama.cpp context and the cache edits queued while it was held."""

    def __init__(self, lock: threading.Lock, queue_edits: bool = True):
        self.lock, self.queue_edits = lock, queue_edits
        self._queued: list[tuple] = []
        self._guard = threading.Lock()  # the queue itself
        self.applied_later = 0  # edits that were queued (for tests and diagnostics)

    def apply_queued(self) -> None:
        """Run the queued edits in order; call with `lock` held."""
        while True:
            with self._guard:
                todo, self._queued = self._queued, []
            if not todo:
                return
            for f, args in todo:
                f(*args)

    def call(self, name: str, f, args: tuple):
        """f(*args) under the lock, after the queued edits; an edit that finds the lock held is queued instead
        (it returns True: done, as far as the caller can tell)."""
        if self.queue_edits and name in QUEUED and not self.lock.acquire(blocking=False):
            with self._guard:
                self._queued.append((f, args))
                self.applied_later += 1
            return True
        if not (self.queue_edits and name in QUEUED):
            self.lock.acquire()
        try:
            self.apply_queued()
            return f(*args)
        finally:
            self.lock.release()


class Locked:
    """llama_cpp's bindings, with every call on the shared context's memory made through `ops` (above)."""

    def __init__(self, lc, ops: MemoryOps):
        self._lc, self._ops = lc, ops

    def __getattr__(self, name: str):
        f = getattr(self._lc, name)
        if not name.startswith("llama_memory_"):
            return f
        ops = self._ops
        return lambda *args: ops.call(name, f, args)
