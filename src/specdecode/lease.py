"""Shared state used by one party at a time. One generation at a time on an Engine: its models hold one KV cache each, so a second generation (or a
cost measurement) that started while a stream is still open would overwrite that stream's cache and
corrupt its output silently. The Lease refuses it with a clear error instead. A stream holds the lease
from its first step until it ends, is closed, or is garbage-collected (closing a generator runs its
`finally`). And one thread at a time in a tokenizer (tokenizer_lock)."""
from __future__ import annotations

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
            raise SpecDecodeError(f"this Engine is busy with another stream that is still open: {what} would "
                                  "overwrite its KV cache. An Engine runs one generation at a time: read that "
                                  "stream to its end, close() it or drop it first, or use another Engine")
        try:
            yield
        finally:
            self._lock.release()


_TOKENIZER_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TOKENIZER_LOCKS_GUARD = threading.Lock()
_ANY_TOKENIZER = threading.RLock()


def tokenizer_lock(tokenizer) -> threading.RLock:
    """The lock held while `tokenizer` encodes or decodes: a fast (Rust) tokenizer used by two threads at once
    can fail ("Already borrowed"), and a server tokenizes requests on handler threads while its worker
    decodes. One lock per tokenizer object, shared by every Engine that holds it."""
    with _TOKENIZER_LOCKS_GUARD:
        try:
            lock = _TOKENIZER_LOCKS.get(tokenizer)
            if lock is None:
                lock = _TOKENIZER_LOCKS[tokenizer] = threading.RLock()
        except TypeError:  # a tokenizer that cannot be weakly referenced or hashed: one lock for all of those
            lock = _ANY_TOKENIZER
        return lock
