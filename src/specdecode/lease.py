"""Shared state used by one party at a time. One generation at a time on an Engine: its models hold one KV cache
each, so a second generation (or a cost measurement) that started while a stream is still open would overwrite that
stream's cache and corrupt its output silently. The Lease refuses it with a clear error instead. A stream holds the
lease from its first step until it ends, is closed, or is garbage-collected (closing a generator runs its `finally`).
And one thread at a time in a tokenizer (tokenizer_lock), or in each of its copies (TokenizerCopies)."""

from __future__ import annotations

import copy
import queue
import threading
import weakref
from contextlib import contextmanager

from .errors import SpecDecodeError


class Lease:
    def __init__(self):
        self._lock = threading.Lock()  # held by the live generation; any thread may release it

    @contextmanager
    def held(self, what: str):
        """Hold the models for `what`; SpecDecodeError at once if a stream holds them."""
        if not self._lock.acquire(blocking=False):
            raise SpecDecodeError(
                f"this Engine is busy with another stream that is still open: {what} would "
                "overwrite its KV cache. An Engine runs one generation at a time: read that "
                "stream to its end, close() it or drop it first, or use another Engine"
            )
        try:
            yield
        finally:
            self._lock.release()


_TOKENIZER_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TOKENIZER_LOCKS_GUARD = threading.Lock()
_ANY_TOKENIZER = threading.RLock()


def tokenizer_lock(tokenizer):
    """The lock held while `tokenizer` encodes or decodes: a fast (Rust) tokenizer used by two threads at once
    can fail ("Already borrowed"), and a server tokenizes requests on handler threads while its worker
    decodes. One lock per tokenizer object, shared by every Engine that holds it; for TokenizerCopies, one of its
    copies lent to the calling thread."""
    if isinstance(tokenizer, TokenizerCopies):
        return tokenizer.lend()
    with _TOKENIZER_LOCKS_GUARD:
        try:
            lock = _TOKENIZER_LOCKS.get(tokenizer)
            if lock is None:
                lock = _TOKENIZER_LOCKS[tokenizer] = threading.RLock()
        except TypeError:  # a tokenizer that cannot be weakly referenced or hashed: one lock for all of those
            lock = _ANY_TOKENIZER
        return lock


class TokenizerCopies:
    """n copies of a tokenizer that n threads encode on at once, standing for it: inside `tokenizer_lock(copies)` (or
    `lend()`) the calling thread holds a free copy, waiting while all n are lent, and calls go to that copy; a call
    outside one borrows a copy for itself. A big request being tokenized holds one copy, not every request's."""

    def __init__(self, tokenizer, n: int):
        self.copies = [copy.deepcopy(tokenizer) for _ in range(n)]
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for c in self.copies:
            self._free.put(c)
        self._held = threading.local()

    @contextmanager
    def lend(self):
        held = getattr(self._held, "copy", None)
        if held is not None:  # this thread holds one already (a call inside tokenizer_lock)
            yield held
            return
        lent = self._free.get()
        self._held.copy = lent
        try:
            yield lent
        finally:
            self._held.copy = None
            self._free.put(lent)

    def __call__(self, *args, **kwargs):
        with self.lend() as tokenizer:
            return tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        if name.startswith("_") or name == "copies":  # not yet set (in __init__, in a copy being made)
            raise AttributeError(name)
        value = getattr(self.copies[0], name)
        if not callable(value):
            return value

        def on_a_copy(*args, **kwargs):
            with self.lend() as tokenizer:
                return getattr(tokenizer, name)(*args, **kwargs)

        return on_a_copy
