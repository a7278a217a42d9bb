"""Streaming text: committed token ids turned into text deltas incrementally, with stop strings."""

from __future__ import annotations

import os
import time
from typing import Callable, Iterator

from .errors import Interrupted
from .prefill import Interrupt
from .request import Encoded
from .stats import Generation, Stats

TAIL_TOKENS = 3  # a character still missing bytes has at most 3: made by at most the last 3 tokens


class TextStream:
    """Turns committed token ids into text deltas; applies stop strings; times the generation.

    Detokenization is incremental, linear in the output length, for any tokenizer with `decode`: each
    step decodes only a window, the tokens whose text was last added (context, for tokenizers whose text
    for a token depends on its neighbours, such as SentencePiece's leading space or byte-level
    characters) plus the new ones, and appends what the new ones add. A UTF-8 character split across
    tokens decodes to U+FFFD until its last byte comes. Where each character's text depends on its own
    bytes only (byte-level BPE, plain pieces) and a character has at most 4 bytes, only a U+FFFD made by
    the last TAIL_TOKENS tokens can still change: that one is held back, any other is the model's own
    text and goes out, and the window slides past it. Where a decoder turns a whole run of byte tokens
    into U+FFFD while one of its characters is incomplete (ByteFallback), the text's trailing U+FFFDs
    are held back until a whole character follows. (tokenizers' DecodeStream holds back any text that
    ends in U+FFFD and keeps every token since: a model that writes U+FFFD gets it late, in quadratic
    time; not used.) Stop strings are matched by a StopMatcher, which reads each character of the text
    once: a tail that could start one is never sent, so none can begin in text sent earlier.
    """

    __slots__ = ("engine", "steps", "stats", "stops", "result", "encoded", "cache_scope", "_interrupt")

    def __init__(
        self,
        engine,
        steps: Iterator[list[int]],
        stats: Stats,
        stops: list[str],
        interrupt=None,
        *,
        encoded: Encoded | None = None,
        cache_scope: str | None = None,
    ):
        """engine: what decodes ids to text (engine.decode); steps: the loop's committed ids, step by step;
        interrupt: the prefill.Interrupt those steps ask between the prompt's passes (they raise Interrupted);
        encoded: the request it runs, tokenized (Engine.open); cache_scope: whose text the target's cache keeps for
        reuse after it (None: no prompt cache)."""
        self.engine, self.steps, self.stats, self.stops = engine, steps, stats, stops
        self.result: Generation | None = None
        self.encoded, self.cache_scope = encoded, cache_scope
        self._interrupt = interrupt if interrupt is not None else Interrupt()

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        """The prompt's tokens (where a server runs it: the batch slot whose cache holds their start)."""
        return self.encoded.prompt_ids if self.encoded is not None else ()

    @property
    def prediction_ids(self) -> tuple[int, ...] | None:
        """The client's prediction, tokenized once: its usage fields are counted at the end."""
        return self.encoded.prediction_ids if self.encoded is not None else None

    def run(self) -> Generation:
        """The whole generation: the stream read to its end, and its result."""
        for _ in self:
            pass
        return self.result

    def reopen(self, engine) -> "TextStream":
        """The same request opened on another engine with the same tokenizer (a batch slot's), not tokenized again;
        the engine named in its stats stays this one's."""
        stream = engine.open(self.encoded)
        stream.stats.engine = self.stats.engine
        return stream

    def wrap_steps(self, wrap: Callable[[Iterator[list[int]]], Iterator[list[int]]]) -> None:
        """Run the loop's steps through `wrap` (it yields what it reads, and closes it): where they run, what
        watches them."""
        self.steps = wrap(self.steps)

    def stop_when(self, check: Callable[[], bool] | None) -> None:
        """Ask `check` after every step and between the prompt's passes: True ends the generation there (the
        server's cancellation and deadline); what was sent is then the result's text."""
        self._interrupt.check = check

    @property
    def interrupt(self) -> Callable[[], bool] | None:
        """What stop_when set (None: nothing)."""
        return self._interrupt.check

    def __iter__(self) -> Iterator[str]:
        decode, stats = self.engine.decode, self.stats
        local = _local_decoder(self.engine)
        ids: list[int] = []
        text = ""  # the text that can no longer change
        context = read = 0  # ids[context:read]: the tokens whose text was added last (their text: `before`)
        before, base = "", 0  # decode(ids[context:read]); len(text of ids[:read])
        sent, interrupted = "", False
        stops = StopMatcher(self.stops)
        t0 = time.perf_counter()
        try:
            for new in self.steps:
                if stats.ttft_s is None:
                    stats.ttft_s, stats.first_tokens = time.perf_counter() - t0, len(new)
                ids += new
                after = decode(ids[context:])
                cut = len(ids) - TAIL_TOKENS  # the text of ids[:cut] is whole, unless a later token changed it
                settled = decode(ids[context:cut]) if local and cut > read else before
                final = len(os.path.commonprefix([settled, after])) if local else len(before)
                end = len(after)
                while end > final and after[end - 1] == "\ufffd":  # a character that may still miss bytes
                    end -= 1
                added = after[len(before) + len(text) - base : end]
                text += added
                if end == len(after) > len(before):  # nothing held back: slide the window past every token
                    context, read, base = read, len(ids), base + len(after) - len(before)
                    before = decode(ids[context:read])
                elif (
                    local
                    and cut > read
                    and after.startswith(settled)
                    and (not settled.endswith("\ufffd") or settled + decode(ids[cut:]) == after)
                ):
                    # ids[:cut] end between two characters (settled's last is whole, or the text is the same
                    # decoded in two parts): slide past them
                    context, read, base = read, cut, base + len(settled) - len(before)
                    before = decode(ids[context:read])
                cut = stops.feed(added)
                if cut is not None:
                    text = text[:cut]
                    ids = _shortest_prefix_with_stop(ids, decode, self.stops)
                    stats.truncate(len(ids))  # draft tokens cut off with the stop's tail were not emitted
                    stats.finish_reason = "stop"
                    safe = len(text)
                else:
                    safe = stops.safe_length()
                if safe > len(sent):
                    delta = text[len(sent) : safe]
                    sent += delta
                    yield delta
                if cut is not None:
                    break
                if self.interrupt is not None and self.interrupt():
                    interrupted = True
                    break
        except Interrupted:  # while the prompt was read, or a cache's text read again
            interrupted = True
        finally:
            self.steps.close()  # frees the loop if the consumer stops early
            stats.wall_s = time.perf_counter() - t0
        yield from self._finish(ids, sent, interrupted)

    def _finish(self, ids: list[int], sent: str, interrupted: bool) -> Iterator[str]:
        """The text's last piece (what was held back for a character's missing bytes), and the result."""
        stats = self.stats
        text = self.engine.decode(ids) if stats.finish_reason != "stop" and not interrupted else sent
        if len(text) > len(sent) and text.startswith(sent):
            yield text[len(sent) :]
        if self.prediction_ids:
            stats.count_prediction(self.prediction_ids, ids)
        self.result = Generation(text, ids, stats)


class StopMatcher:
    """Stop strings found in text that arrives piece by piece, in time linear in the text: one
    Knuth-Morris-Pratt automaton per stop string reads each new character once (amortized), whatever the
    stop strings' length; nothing already read is scanned again."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.fail = [_failure(s) for s in stops]
        # states[j][i]: the length of the longest prefix of stops[j] that text[:i] ends with
        self.states = [[0] for _ in stops]
        self.length = 0  # characters fed

    def feed(self, added: str) -> int | None:
        """Read `added` (appended to the text); where the first stop string starts if one now occurs (the
        earliest start among each stop string's first occurrence), else None."""
        first = None
        for s, fail, states in zip(self.stops, self.fail, self.states):
            k = states[-1]
            for i, c in enumerate(added):
                while k and s[k] != c:
                    k = fail[k - 1]
                if s[k] == c:
                    k += 1
                if k == len(s):  # an occurrence ends at character i: the stream ends there
                    start = self.length + i + 1 - k
                    first = start if first is None else min(first, start)
                    break
                states.append(k)
        self.length += len(added)
        return first

    def safe_length(self) -> int:
        """How much of the text can be sent: a tail that could start a stop string is held back (for each
        stop string in turn, the longest of its prefixes that the text so far ends with)."""
        end = self.length
        for states in self.states:
            end -= states[end]
        return end


def _local_decoder(engine) -> bool:
    """Whether the engine's decoder gives each character's text from its own bytes alone: not so for tokenizers'
    ByteFallback (a run of byte tokens is all U+FFFD while any of its characters is incomplete), nor for a
    tokenizer whose decoder is not known here (slow ones); an engine without a tokenizer decodes its own way."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        return True
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = backend.decoder  # its JSON is a few hundred bytes: read per generation
    return decoder is None or b'"ByteFallback"' not in decoder.__getstate__()


def _failure(s: str) -> list[int]:
    """KMP's failure function: fail[i] is the longest proper prefix of s[:i + 1] that is also its suffix."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


def _shortest_prefix_with_stop(ids: list[int], decode, stops: list[str]) -> list[int]:
    k = len(ids)
    while k > 1 and any(s in decode(ids[: k - 1]) for s in stops):
        k -= 1
    return ids[:k]
