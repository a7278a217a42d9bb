"""The n-gram tables of lookup drafting: the context's (NgramIndex, over the prompt and output) and the
engine's History of earlier outputs. Each answers lookup(text, depth, limit) for the lookup drafter."""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict

from ..errors import SpecDecodeError

MAX_NGRAM = 4  # context and history: match up to the last 4 tokens (prompt lookup used 3)
SEP = -1  # between the sequences of an n-gram table


class NgramIndex:
    """Every n-gram (n <= max_n) of a growing token list, with the positions just after each of its
    occurrences. Sequences are separated by SEP; no n-gram or continuation crosses a separator."""

    def __init__(self, max_n: int = MAX_NGRAM):
        self.max_n = max_n
        self.tokens: list[int] = []
        self.ends: dict[tuple, list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new) -> None:
        toks, ends = self.tokens, self.ends
        for x in new:
            toks.append(int(x))
            end = len(toks)
            for n in range(1, self.max_n + 1):
                if n > end or toks[end - n] == SEP:
                    break
                ends.setdefault(tuple(toks[end - n : end]), []).append(end)

    def match(self, text: list[int], limit: int, live=None) -> tuple[int, list[int]]:
        """(n, ends): the longest suffix of text (n <= max_n) that occurred with a continuation, and
        the positions after its latest `limit` such occurrences (latest first). live(end) filters."""
        last = len(self.tokens)
        for n in range(min(self.max_n, len(text)), 0, -1):
            found = []
            for end in reversed(self.ends.get(tuple(text[-n:]), ())):
                if end < last and self.tokens[end] != SEP and (live is None or live(end)):
                    found.append(end)
                    if len(found) == limit:
                        break
            if found:
                return n, found
        return 0, []

    def continuation(self, end: int, depth: int) -> list[int]:
        out = self.tokens[end : end + depth]
        return out[: out.index(SEP)] if SEP in out else out

    def lookup(self, text: list[int], depth: int, limit: int) -> tuple[int, list[list[int]], list]:
        """(n, continuations up to depth tokens, their refs): what a source gives the drafter."""
        n, ends = self.match(text, limit)
        return n, [self.continuation(e, depth) for e in ends], [None] * len(ends)


class History:
    """The engine's earlier outputs (never their prompts: another client's prompt text is not for drafting
    from), at most max_tokens of them; when full, the least recently used output goes (used = added, or one of its
    guesses accepted). Dead entries are dropped from the table once they outnumber the live ones. Thread-safe:
    the generations of a batching server (one thread each) add to and draft from one History."""

    def __init__(self, max_tokens: int = 1_000_000, max_n: int = MAX_NGRAM):
        self._lock = getattr(self, "_lock", None) or threading.RLock()
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise SpecDecodeError(f"history_tokens must be a non-negative integer, got {max_tokens!r}")
        self.max_tokens, self.max_n = max_tokens, max_n
        self.index = NgramIndex(max_n)
        self.starts: list[int] = []  # start position of every sequence ever stored (dead ones too)
        self.live: OrderedDict[int, int] = OrderedDict()  # sequence -> its length, least recently used first
        self.live_tokens = 0
        self.next_id = 0
        self.ids: list[int] = []  # sequence id of each entry in starts

    def add(self, output_ids: list[int]) -> None:
        with self._lock:
            self._add(list(output_ids))

    def _add(self, seq: list[int]) -> None:
        if not seq or len(seq) > self.max_tokens:
            return
        while self.live_tokens + len(seq) > self.max_tokens:
            _, n = self.live.popitem(last=False)
            self.live_tokens -= n
        dead = len(self.index) - self.live_tokens - len(self.live)  # tokens (and separators) of dead sequences
        if dead > self.live_tokens + len(self.live):
            self._compact()
        self.starts.append(len(self.index))
        self.ids.append(self.next_id)
        self.index.extend(seq + [SEP])
        self.live[self.next_id] = len(seq)
        self.live_tokens += len(seq)
        self.next_id += 1

    def _compact(self) -> None:
        old, starts, ids = self.index, self.starts, self.ids
        self.index, self.starts, self.ids = NgramIndex(self.max_n), [], []
        for k, (start, seq) in enumerate(zip(starts, ids)):
            if seq in self.live:
                end = starts[k + 1] if k + 1 < len(starts) else len(old)
                self.starts.append(len(self.index))
                self.ids.append(seq)
                self.index.extend(old.tokens[start:end])

    def sequence_at(self, pos: int) -> int:
        return self.ids[bisect.bisect_right(self.starts, pos) - 1]

    def match(self, text: list[int], limit: int) -> tuple[int, list[int]]:
        return self.index.match(text, limit, live=lambda end: self.sequence_at(end) in self.live)

    def lookup(self, text: list[int], depth: int, limit: int) -> tuple[int, list[list[int]], list]:
        """As NgramIndex.lookup; each continuation's ref is the stored output it came from."""
        with self._lock:
            n, ends = self.match(text, limit)
            return n, [self.index.continuation(e, depth) for e in ends], [self.sequence_at(e) for e in ends]

    def touch(self, seqs) -> None:
        with self._lock:
            for s in seqs:
                if s in self.live:
                    self.live.move_to_end(s)

    def clear(self) -> None:
        with self._lock:
            self.__init__(self.max_tokens, self.max_n)
