"""One generation at a time on an Engine: its models hold one KV cache each, so a second generation (or a
cost measurement) that started while a stream is still open would overwrite that stream's cache and
corrupt its output silently. The Lease refuses it with a clear error instead. A stream holds the lease
from its first step until it ends, is closed, or is garbage-collected (closing a generator runs its
`finally`)."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

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

    def steps(self, steps: Iterator[list[int]]) -> Iterator[list[int]]:
        """A generation's steps, run while holding the lease (taken at the first step, not when opened)."""
        with self.held("starting a second generation"):
            try:
                yield from steps
            finally:
                steps.close()
