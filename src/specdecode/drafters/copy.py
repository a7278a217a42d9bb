"""Copy following: guesses that ride a text the output repeats, through the edits it makes.

An edit's answer (a refactored function, a JSON document with one field changed) repeats, token for token,
a text the client already holds: a prediction it sends (OpenAI's Predicted Outputs), or the file in the
prompt. `Alignment` keeps the position in that reference text where the output now stands; while the output
goes on as the reference does, it proposes the reference's next tokens. At an edit point (the target emitted
something else) the alignment is lost; it re-synchronises as soon as the output's last tokens occur again in
the reference (the occurrence with the longest common run, the nearest one ahead of the last position among
equals), so the copy resumes right after an inserted, deleted or changed span. A span the output wrote in place
of a span of the reference is remembered, and expected again where that span comes back (a rename: every later
occurrence of the old name is guessed as the new one; where the output keeps the original, the copy goes on).

The value of a guess is a mixture of two explanations of the run of r tokens the output has just copied: the
alignment is genuine (the output copies the reference, leaving it at an edit point with a per-token hazard h, this
reference's breaks per copied token so far, learned apart for the first NEAR tokens after an alignment is made, where
edit points cluster, and for those further on) or spurious (a chance match, which goes on with probability
SPURIOUS_GO_ON a token). The run weighs them (Bayes, from the source's prior odds), and the j-th guess ahead is taken
with P(genuine | r) (1 - h)^j + P(spurious | r) SPURIOUS_GO_ON^j. So a copy that re-synchronises after an edit point on
a long common run is trusted at once as far as the reference's own record allows, a short match backs off, and a
reference that is wrong from the start (another file) breaks often, its hazard grows, and it is soon not drafted from.

A client's prediction is also re-synchronised on less evidence, tentatively: where the output's last 2 (or 1) tokens
occur once only in the prediction, and where the output writes again the token the copy last followed before it broke
(an inserted line ends on the same newline and indentation as the line before it, and the original goes on after it).
A tentative alignment that breaks before SYNC_MIN tokens is not a break of the copy; its guesses are valued as a
genuine copy only, at odds learned from how often this reference's tentative alignments held. Only a reference the
output has been seen to copy is re-synchronised so (a wrong prediction shares short pieces with any output).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from .ngram_index import NgramIndex

SYNC_MIN = 3  # output tokens that must match the reference to (re)align on it
SYNC_RUN_MAX = 64  # how far back a candidate alignment's common run is measured
SYNC_CANDIDATES = 64  # occurrences of the last SYNC_MIN tokens compared per re-synchronisation, nearest first
BREAK_PRIOR = 8.0  # a reference starts with a hazard of one break per BREAK_PRIOR tokens, learned from then on
NEAR = 8  # the first tokens after an alignment is (re)made: edits cluster, so their hazard is learned apart
FAR_PRIOR = 32.0  # past them a reference starts with one break per FAR_PRIOR tokens (BREAK_PRIOR near a sync)
SPURIOUS_GO_ON = 0.7  # P(a chance match of the output and the reference goes on one more token)
PRIOR_ODDS = {"prediction": 1.0, "context": 1 / 3}  # odds of a genuine copy before any run: the client's own
# prediction is meant to be copied; a prompt is mostly not repeated, and code repeats short pieces of itself
EDIT_MAX = 16  # the longest span a remembered substitution replaces or writes (a rename, a changed argument)
TENTATIVE = ("prediction",)  # the sources re-synchronised tentatively (a prompt repeats short pieces everywhere)
TENTATIVE_MISSES = 4  # tentative alignments that may fail beyond those that held before a reference gets no more


@dataclass
class CopyGuess:
    """The reference's next tokens and, for each, P(the target takes the path to it)."""

    tokens: list[int]
    values: list[float]
    run: int  # tokens copied in a row before them
    source: str


class Alignment:
    """Follows `reference` (token ids) through the output, which starts at ids[start:].

    aligned: the output's end stands before reference[pos] (pos is not None)."""

    def __init__(self, reference: list[int], source: str, start: int, aligned_at_start: bool):
        self.reference = [int(x) for x in reference]
        self.source, self.start = source, start
        self.pos: int | None = 0 if aligned_at_start and self.reference else None
        self.last = 0  # where the reference was last followed: re-synchronisation looks near it first
        self.run = 0  # tokens copied in a row (at a re-synchronisation: the common run found)
        self.seen = 0  # output tokens already followed
        self.since = 0  # tokens copied since the alignment was last made (at the start, a re-synchronisation)
        # (copied, breaks) within NEAR tokens of an alignment's making, and past them: output tokens that went on as the
        # reference did while aligned, and times the output left it
        self.near, self.far = [0, 0], [0, 0]
        self._broke: tuple[int, int] | None = None  # (output index, reference position) of the last break
        self._edits: dict[tuple, tuple] = {}  # substitutions the output made: reference span -> what it wrote
        self._by_first: dict[int, list[tuple]] = {}  # their reference spans by first token, longest first
        self.pending: list[int] = []  # the rest of a substitution the output is expected to write now
        self._pending_end = 0  # where the reference goes on after it
        self.tentative = False  # aligned on less than SYNC_MIN tokens of evidence (see the module's docstring)
        self.held = [0, 0]  # tentative alignments that reached SYNC_MIN tokens, and those that broke before
        self._short: dict[int, NgramIndex] | None = None  # 1- and 2-grams of the reference (tentative alignments)
        # SYNC_MIN-gram -> positions just after its occurrences, ascending: 12 bytes a reference token (ngram_index.py)
        self._index = NgramIndex(self.reference, SYNC_MIN)

    def follow(self, ids: list[int]) -> None:
        """Bring the alignment up to date with the output ids[start:]."""
        out = ids[self.start :]
        ref = self.reference
        for i in range(self.seen, len(out)):
            x = out[i]
            if self.pos is not None:
                expected = self._expected(1)
                if expected and expected[0] == x:
                    self._advance()
                    if self.tentative and self.run >= SYNC_MIN:  # it held: as good as a re-synchronisation
                        self.tentative = False
                        self.held[0] += 1
                        self._learn(out, i + 1)
                    continue
                if self.pending and self.pos < len(ref) and ref[self.pos] == x:  # the original kept here
                    self.pending = []
                    self._advance()
                    continue
                if self.tentative:  # a tentative alignment that did not hold: the copy's own break still stands
                    self.held[1] += 1
                    self.tentative, self.pos, self.run, self.pending = False, None, 0, []
                else:
                    (self.near if self.since < NEAR else self.far)[1] += 1
                    self._broke = (i, self.pos)
                    self.last, self.pos, self.run, self.pending = self.pos, None, 0, []
            if i + 1 >= SYNC_MIN:
                self._sync(out, i + 1)
            if self.pos is None and self.source in TENTATIVE and self._trusted:
                self._resume(out, i + 1)
        self.seen = len(out)

    @property
    def _trusted(self) -> bool:
        """Whether a short match is evidence here: the output has copied this reference more than the prior's tokens per
        break, and its tentative alignments have not failed TENTATIVE_MISSES times more often than they held."""
        return self.copied > BREAK_PRIOR * self.breaks and self.held[1] < self.held[0] + TENTATIVE_MISSES

    def _resume(self, out: list[int], n: int) -> None:
        """Tentatively re-align after out[:n]: where its last 2, then 1, tokens occur once only in the reference, or
        right after the break where the output writes again the token the copy followed last before it."""
        if self._short is None:  # built on the first edit point only
            self._short = {size: NgramIndex(self.reference, size) for size in (1, 2)}

        def once(size: int) -> int:  # the position after the output's last `size` tokens, where they occur once only
            ends = self._short[size].get(out[n - size : n]) if n >= size else ()
            return ends[0] if len(ends) == 1 else -1

        broke = self._broke[1] if self._broke is not None else 0
        found = [(2, once(2))]
        if broke > 0 and out[n - 1] == self.reference[broke - 1]:
            found.append((1, broke))
        found.append((1, once(1)))
        for run, end in found:
            if 0 < end < len(self.reference):
                self.pos, self.run, self.tentative, self.since = end, run, True, 0
                return

    def _advance(self) -> None:
        """The output went on as expected: one token further in the pending substitution or the reference."""
        if self.pending:
            self.pending.pop(0)
            if not self.pending:
                self.pos = self._pending_end
        else:
            self.pos += 1
        self.run += 1
        (self.near if self.since < NEAR else self.far)[0] += 1
        self.since += 1

    def _expected(self, n: int) -> list[int]:
        """The next n tokens the output should write if it goes on as before: the reference, with every edit it
        made once (a substitution, such as a rename) made again where the same span comes back."""
        ref, pos = self.reference, self.pos
        if not self.pending and self._edits:
            self._start_edit()
        out, pos = list(self.pending[:n]), self._pending_end if self.pending else pos
        while len(out) < n and pos < len(ref):
            key = self._edit_at(pos)
            if key is None:
                out.append(ref[pos])
                pos += 1
            else:
                out += self._edits[key]
                pos += len(key)
        return out[:n]

    def _start_edit(self) -> None:
        key = self._edit_at(self.pos)
        if key is not None:
            self.pending, self._pending_end = list(self._edits[key]), self.pos + len(key)

    def _edit_at(self, pos: int) -> tuple | None:
        """The longest learned substitution whose original span starts at reference[pos] (None: none)."""
        ref = self.reference
        for key in self._by_first.get(ref[pos], ()) if pos < len(ref) else ():
            if tuple(ref[pos : pos + len(key)]) == key:
                return key
        return None

    def _learn(self, out: list[int], n: int) -> None:
        """After a re-synchronisation: the span the output wrote in place of a span of the reference (between the
        break and the common run that realigned it) is remembered as a substitution to expect again."""
        if self._broke is None:
            return
        (out_at, ref_at), self._broke = self._broke, None
        out_end, ref_end = n - self.run, self.pos - self.run
        if out_at <= out_end and ref_at < ref_end and 0 < out_end - out_at <= EDIT_MAX and ref_end - ref_at <= EDIT_MAX:
            key = tuple(self.reference[ref_at:ref_end])
            if key not in self._edits:
                self._by_first.setdefault(key[0], []).append(key)
                self._by_first[key[0]].sort(key=len, reverse=True)
            self._edits[key] = tuple(out[out_at:out_end])

    def _sync(self, out: list[int], n: int) -> None:
        """Re-align after out[:n] on the occurrence of its last tokens with the longest common run."""
        ends = self._index.get(tuple(out[n - SYNC_MIN : n]))
        if not ends:
            return
        # nearest first: those at or ahead of the last position, then those behind it
        k = bisect_left(ends, self.last)
        order = ends[k : k + SYNC_CANDIDATES] + ends[max(0, k - SYNC_CANDIDATES) : k][::-1]
        best_end, best_run = None, 0
        ref = self.reference
        for end in order[:SYNC_CANDIDATES]:
            run = SYNC_MIN
            while run < SYNC_RUN_MAX and run < n and run < end and ref[end - run - 1] == out[n - run - 1]:
                run += 1
            if run > best_run:
                best_end, best_run = end, run
        if best_end is not None and best_end < len(ref):
            self.pos, self.run, self.tentative, self.since = best_end, best_run, False, 0
            self._learn(out, n)

    @property
    def copied(self) -> int:
        return self.near[0] + self.far[0]

    @property
    def breaks(self) -> int:
        return self.near[1] + self.far[1]

    def hazards(self, n: int) -> list[float]:
        """P(the output leaves the reference at each of its next n tokens) while it genuinely copies it: near an
        alignment's making this reference's breaks per copied token there (prior: one in BREAK_PRIOR), past it
        those further on (prior: one in FAR_PRIOR). An edit point seldom comes alone."""
        near = (self.near[1] + 1) / (self.near[0] + self.near[1] + BREAK_PRIOR)
        far = (self.far[1] + 1) / (self.far[0] + self.far[1] + FAR_PRIOR)
        return [near if self.since + j < NEAR else far for j in range(n)]

    def guess(self, ids: list[int], depth: int) -> CopyGuess | None:
        """The reference's next tokens (at most depth) with their values; None where it is not aligned."""
        self.follow(ids)
        if self.pos is None or depth <= 0 or (self.pos >= len(self.reference) and not self.pending):
            return None
        tokens = self._expected(depth)
        odds = PRIOR_ODDS.get(self.source, 1.0)
        if self.tentative:  # a short match is no evidence of a chance copy going on: valued as a genuine one only
            odds *= (self.held[0] + 1) / (self.held[1] + 1)
            values = copy_values(self.run, self.hazards(len(tokens)), len(tokens), odds, spurious=False)
        else:
            values = copy_values(self.run, self.hazards(len(tokens)), len(tokens), odds)
        return CopyGuess(tokens, values, self.run, self.source)


def copy_values(run: int, hazard: float | list[float], n: int, odds: float = 1.0, spurious: bool = True) -> list[float]:
    """P(the target takes each of the next n copied tokens, the path to it included) after `run` tokens copied in
    a row: genuine copy (hazard per token, or a list of the next n tokens' hazards) or chance match (SPURIOUS_GO_ON
    per token; not counted where spurious is False), weighed by the run from prior odds `odds` of a genuine copy."""
    hazards = [hazard] * n if isinstance(hazard, (int, float)) else list(hazard)
    keep = 1.0 - (hazards[0] if hazards else 0.0)  # the run's likelihood as a genuine copy: at the next token's
    genuine = 1.0 / (1.0 + (SPURIOUS_GO_ON / keep) ** run / odds) if keep > 0 else 0.0
    chance = (1.0 - genuine) if spurious else 0.0
    values, path = [], 1.0
    for j, h in enumerate(hazards[:n], 1):
        path *= 1.0 - h
        values.append(genuine * path + chance * SPURIOUS_GO_ON**j)
    return values


def followed(prompt_ids, prediction_ids, start: int | None = None) -> list[Alignment]:
    """The texts a generation's output is followed through: the client's prediction (aligned from the output's
    first token), then the prompt (aligned once the output repeats a piece of it). start: where the output
    begins (default: after the prompt)."""
    start = len(prompt_ids) if start is None else start
    out = [Alignment(prediction_ids, "prediction", start, True)] if prediction_ids else []
    return out + ([Alignment(prompt_ids, "context", start, False)] if prompt_ids else [])
