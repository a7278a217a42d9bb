"""Where each token of a streamed answer came from, cut to the text deltas the stream sends.

A TextStream sends text, not tokens: it holds back the bytes of an unfinished character and any tail that could
start a stop string, so a delta may hold part of a token, or several. `Provenance` watches the committed ids of
one stream, measures each token's share of the text (the text its arrival settles: a character split across tokens
goes with its last one; the window decoded is a few tokens since the last character boundary) and hands
each delta its tokens: entries whose texts add up to the delta exactly, one per token, or more where a delta
boundary falls inside a token (the same `token` index twice). With `rest()` at the end, every token of the
answer has at least one entry, also those with no text (the end-of-text token, the first bytes of a character).
"""

from __future__ import annotations

import os
from collections import deque

from ..textstream import TAIL_TOKENS, _local_decoder

TARGET = "target"  # the target's own token at a step (its bonus or residual draw, or a plain step)


class Provenance:
    """Per-token sources of one TextStream; create it before the stream starts, call `take` with each delta it
    yields (on the thread that iterates it: the stream's stats change as it runs), then `rest` at its end."""

    def __init__(self, stream, public=lambda source: source):
        """public: the source name a client may see for each recorded source (a server can hide one)."""
        self.stats, self.decode, self.public = stream.stats, stream.engine.decode, public
        self._local = _local_decoder(stream.engine)
        self.ids: list[int] = []
        stream.wrap_steps(self._watch)
        self._queue: deque[list] = deque()  # [token, characters, info, entered]: tokens whose text is not all sent
        self._used = 0  # characters of the queue's first token already sent
        self._known = 0  # tokens measured and queued (or sent)
        self._last: dict | None = None  # the last token that got an entry: where unexplained text goes
        self._pass = self._in_pass = 0  # the pass of token _known in stats.passes, and its place in that pass
        # The window decoded for each new token, as TextStream's: ids[_context:], where ids[:_context] and
        # ids[:_read] end between two characters and ids[_context:_read] (decoding to _prefix) give the tokens after
        # them their context (a leading space); _settled: characters of the window past _prefix already measured.
        self._context = self._read = self._settled = 0
        self._prefix = ""

    def _watch(self, steps):
        try:
            for new in steps:
                self.ids += new
                yield new
        finally:
            steps.close()

    def take(self, delta: str) -> list[dict]:
        """The entries of the tokens that `delta` (the stream's next piece of text) covers."""
        self._measure()
        out, pos = [], 0
        while self._queue:
            item = self._queue[0]
            token, length, info, entered = item
            take = min(length - self._used, len(delta) - pos)
            if take > 0 or not entered:
                if take <= 0 and length > self._used:
                    break  # the delta ended before this token's text began: it comes with a later delta
                out.append(self._entry(token, delta[pos : pos + take], info))
                item[3] = True
                pos += take
                self._used += take
            if self._used < length:
                break
            self._queue.popleft()
            self._used = 0
        if pos < len(delta):  # text no measured token explains (a decoder that merges tokens): the last one's
            last = self._last or dict(token=0, source=TARGET, step=1, drafted=0, accepted=0)
            out.append({**last, "text": delta[pos:]})
        return out

    def rest(self) -> list[dict]:
        """At the stream's end: an entry with no text for each token that has none yet (no text of its own, or its
        text cut off at a stop string)."""
        self._measure()
        out = [self._entry(token, "", info) for token, _, info, entered in self._queue if not entered]
        self._queue.clear()
        self._used = 0
        return out

    def _entry(self, token: int, text: str, info: dict) -> dict:
        self._last = {"token": token, "text": text, **info}
        return self._last

    def _measure(self) -> None:
        """Queue the tokens committed since the last call, each with its share of the text and its pass."""
        n = min(len(self.ids), self.stats.new_tokens)  # a stop string cut the output to its first new_tokens
        if n < self._known:  # tokens measured before the cut: gone, and the pass walk starts over
            self._queue = deque(item for item in self._queue if item[0] < n)
            self._pass = self._in_pass = 0
            for _ in range(n):
                self._info()
            self._known = n
        for k in range(self._known, n):
            tail = self.decode(self.ids[self._context : k + 1])[len(self._prefix) :]
            settled = self._settled_length(tail, k + 1 - TAIL_TOKENS)
            self._queue.append([k, max(0, settled - self._settled), self._info(), False])
            self._settled = max(self._settled, settled)
            if settled == len(tail):  # ids[:k + 1] end between two characters: the window moves past them
                self._context, self._read = self._read, k + 1
                self._prefix, self._settled = self.decode(self.ids[self._context : self._read]), 0
            self._known += 1

    def _settled_length(self, tail: str, cut: int) -> int:
        """How much of the window's text past _prefix the stream can send, by TextStream's rule: a trailing U+FFFD
        waits for its character's last bytes, unless (where each character decodes from its own bytes) tokens before
        the last TAIL_TOKENS made it, which no later byte can change."""
        final = 0
        if self._local and cut > self._read:
            final = len(os.path.commonprefix([self.decode(self.ids[self._context : cut])[len(self._prefix) :], tail]))
        end = len(tail)
        while end > final and tail[end - 1] == "\ufffd":
            end -= 1
        return end

    def _info(self) -> dict:
        """The source and pass of the next token (token _known), stepping the pass walk on by one token."""
        passes = self.stats.passes
        while self._in_pass >= passes[self._pass][0]:  # this pass's tokens are done (or it emitted none)
            self._pass, self._in_pass = self._pass + 1, 0
        emitted, accepted, sources, drafted = passes[self._pass]
        source = sources[self._in_pass] if self._in_pass < len(sources) else TARGET
        self._in_pass += 1
        return {"source": self.public(source), "step": self._pass + 1, "drafted": drafted, "accepted": accepted}
