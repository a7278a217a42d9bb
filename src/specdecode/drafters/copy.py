"""Copy following: guesses that ride a text the output repeats, through the edits it makes.

An edit's answer (a refactored function, a JSON document with one field changed) repeats, token for token,
a text the client already holds: a prediction it sends (OpenAI's Predicted Outputs), or the file in the
prompt. `Alignment` keeps the position in that reference text where the output now stands; while the output
goes on as the reference does, it proposes the reference's next tokens. At an edit point (the target emitted
something else) the alignment is lost; it re-synchronises as soon as the output's last tokens occur again in
the reference (the occurrence with the longest common run, the nearest one ahead of the last position among
equals), so the copy resumes right after an inserted, deleted or changed span.

The value of a guess comes from the run of successes it continues: after r tokens copied in a row, the next
is taken with probability (r + 1) / (r + 2) (Laplace's rule of succession), at most the rate at which this
reference has gone on so far in this generation (its breaks per copied token). So a long run yields a deep chain, an edit point backs off at once, and
a reference that is wrong from the start (another file) is soon not drafted from at all.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

SYNC_MIN = 3  # output tokens that must match the reference to (re)align on it
SYNC_RUN_MAX = 64  # how far back a candidate alignment's common run is measured
SYNC_CANDIDATES = 64  # occurrences of the last SYNC_MIN tokens compared per re-synchronisation, nearest first
BREAK_PRIOR = 8.0  # copied tokens a reference is credited with before its first break


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
        self.copied = 0  # output tokens that went on as the reference did, while aligned
        self.breaks = 0  # times the output left the reference while aligned
        self._index: dict[tuple, list[int]] = {}  # SYNC_MIN-gram -> positions just after its occurrences, ascending
        ref = self.reference
        for end in range(SYNC_MIN, len(ref) + 1):
            self._index.setdefault(tuple(ref[end - SYNC_MIN:end]), []).append(end)

    def follow(self, ids: list[int]) -> None:
        """Bring the alignment up to date with the output ids[start:]."""
        out = ids[self.start:]
        ref = self.reference
        for i in range(self.seen, len(out)):
            x = out[i]
            if self.pos is not None:
                if self.pos < len(ref) and ref[self.pos] == x:
                    self.pos += 1
                    self.run += 1
                    self.copied += 1
                    continue
                self.breaks += 1
                self.last, self.pos, self.run = self.pos, None, 0
            if i + 1 >= SYNC_MIN:
                self._sync(out, i + 1)
        self.seen = len(out)

    def _sync(self, out: list[int], n: int) -> None:
        """Re-align after out[:n] on the occurrence of its last tokens with the longest common run."""
        ends = self._index.get(tuple(out[n - SYNC_MIN:n]))
        if not ends:
            return
        # nearest first: those at or ahead of the last position, then those behind it
        k = bisect_left(ends, self.last)
        order = ends[k:k + SYNC_CANDIDATES] + ends[max(0, k - SYNC_CANDIDATES):k][::-1]
        best_end, best_run = None, 0
        ref = self.reference
        for end in order[:SYNC_CANDIDATES]:
            run = SYNC_MIN
            while run < SYNC_RUN_MAX and run < n and run < end and ref[end - run - 1] == out[n - run - 1]:
                run += 1
            if run > best_run:
                best_end, best_run = end, run
        if best_end is not None and best_end < len(ref):
            self.pos, self.run = best_end, best_run

    def guess(self, ids: list[int], depth: int) -> CopyGuess | None:
        """The reference's next tokens (at most depth) with their values; None where it is not aligned."""
        self.follow(ids)
        if self.pos is None or depth <= 0 or self.pos >= len(self.reference):
            return None
        tokens = self.reference[self.pos:self.pos + depth]
        # the reference's own record: breaks per copied token, from a prior of BREAK_PRIOR clean tokens
        trust = (self.copied + BREAK_PRIOR) / (self.copied + self.breaks + BREAK_PRIOR)
        values, v = [], 1.0
        for j in range(len(tokens)):
            r = self.run + j
            v *= min(trust, (r + 1) / (r + 2))
            values.append(v)
        return CopyGuess(tokens, values, self.run, self.source)


def followed(prompt_ids, prediction_ids, start: int | None = None) -> list[Alignment]:
    """The texts a generation's output is followed through: the client's prediction (aligned from the output's
    first token), then the prompt (aligned once the output repeats a piece of it). start: where the output
    begins (default: after the prompt)."""
    start = len(prompt_ids) if start is None else start
    out = [Alignment(prediction_ids, "prediction", start, True)] if prediction_ids else []
    return out + ([Alignment(prompt_ids, "context", start, False)] if prompt_ids else [])
