"""Streaming text: committed token ids turned into text deltas incrementally, with stop strings."""
from __future__ import annotations

import time
from typing import Iterator

from .stats import Generation, Stats


class TextStream:
    """Turns committed token ids into text deltas; applies stop strings; times the generation.

    Detokenization is incremental, linear in the output length, for any tokenizer with `decode`: each
    step decodes only a window, the tokens whose text was last added (context, for tokenizers whose text
    for a token depends on its neighbours, such as SentencePiece's leading space or byte-level
    characters) plus the new ones, and appends what the new ones add. Tokens whose text is not complete
    (a UTF-8 character split across tokens decodes to U+FFFD) stay in the window until it is. Stop
    strings are searched only near the end of the text: a tail that could start one is never sent, so
    none can begin in text sent earlier.
    """

    def __init__(self, engine, steps: Iterator[list[int]], stats: Stats, stops: list[str]):
        """engine: what decodes ids to text (engine.decode); steps: the loop's committed ids, step by step."""
        self.engine, self.steps, self.stats, self.stops = engine, steps, stats, stops
        self.result: Generation | None = None

    def __iter__(self) -> Iterator[str]:
        decode, stats = self.engine.decode, self.stats
        ids: list[int] = []
        text = ""  # the text of ids[:read], then the whole characters of ids[read:] so far (`pending` of them)
        context = read = pending = 0  # ids[context:read]: the tokens whose text was added last
        sent = ""
        t0 = time.perf_counter()
        try:
            for new in self.steps:
                if stats.ttft_s is None:
                    stats.ttft_s, stats.first_tokens = time.perf_counter() - t0, len(new)
                ids += new
                before, after = decode(ids[context:read]), decode(ids[context:])
                whole = len(after)
                while whole and after[whole - 1] == "\ufffd":  # a character still missing some of its bytes
                    whole -= 1
                added = after[len(before) + pending:whole]
                text += added
                pending += len(added)
                if whole == len(after) > len(before):  # every token's text is complete: slide the window
                    context, read, pending = read, len(ids), 0
                cut = self._find_stop(text, len(sent))
                if cut is not None:
                    text = text[:cut]
                    ids = _shortest_prefix_with_stop(ids, decode, self.stops)
                    stats.truncate(len(ids))  # draft tokens cut off with the stop's tail were not emitted
                    stats.finish_reason = "stop"
                    safe = len(text)
                else:
                    safe = self._safe_length(text)
                if safe > len(sent):
                    delta = text[len(sent):safe]
                    sent += delta
                    yield delta
                if cut is not None:
                    break
        finally:
            self.steps.close()  # frees the loop if the consumer stops early
            stats.wall_s = time.perf_counter() - t0
        text = decode(ids) if stats.finish_reason != "stop" else sent
        if len(text) > len(sent) and text.startswith(sent):
            yield text[len(sent):]
        self.result = Generation(text, ids, stats)

    def _find_stop(self, text: str, sent: int) -> int | None:
        """Where the first stop string starts; one can start only in the text not sent yet (or reach into it)."""
        start = max(0, sent - max((len(s) for s in self.stops), default=0))
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _safe_length(self, text: str) -> int:
        """Hold back any tail that could start a stop string (text holds only whole characters). Only the
        last sum(len(stop)) characters can be held back, so only they are looked at."""
        base = max(0, len(text) - sum(len(s) for s in self.stops) - 1)
        tail = text[base:]
        end = len(tail)
        for s in self.stops:
            for k in range(min(len(s) - 1, end), 0, -1):
                if tail[:end].endswith(s[:k]):
                    end -= k
                    break
        return base + end


def _shortest_prefix_with_stop(ids: list[int], decode, stops: list[str]) -> list[int]:
    k = len(ids)
    while k > 1 and any(s in decode(ids[:k - 1]) for s in stops):
        k -= 1
    return ids[:k]
