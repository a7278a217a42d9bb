"""Exact greedy mode: which target passes compute every token's logits bit for bit as plain decoding does.

A matrix kernel may change with the number of rows it is given (llama.cpp: repacked weights take
groups of 4 tokens and leftovers one by one, K-quants switch to a tiled kernel from 8 tokens, the
attention without flash attention multiplies whole matrices; torch: oneDNN/MKL pick kernels by row
count). Then a token verified in a pass of k tokens gets logits a rounding away from the ones plain
decoding computes, and a near-tie can fall the other way. Which pass sizes keep every row identical is a
property of the machine, the build and the model file, so it is measured here, not assumed: the logits
of a 1-token-at-a-time decoding against the same tokens fed k at a time, for k = 2, 3, ... until a row
differs in one bit; then a tree pass whose accepted branch leaves a rejected node below it, followed by
more plain steps. The result is cached per model and machine (LM.describe()).

Exact mode (Engine(..., exact=True), --exact) then never feeds the target a pass longer than
`max_pass` tokens and uses trees only if `trees`; every token it emits is the argmax of logits bit-identical
to plain decoding's, so the greedy output equals plain decoding's token for token.

Padding (torch): where a 1-row pass takes other kernels than every longer pass (oneDNN on a CPU, cuBLAS on a
GPU), no pass of 2 tokens is exact against 1-token steps. Padding every pass to 2 rows (LM.pad_rows) makes
plain decoding's steps run the kernels of a 2-row pass, so longer passes may then match them. Exact mode pads only
where that is
measured to make longer passes exact and to cost a 1-token step at most PAD_COST more: plain decoding in exact
mode is then the padded one (its tokens equal unpadded decoding's except where the top two logits are within a
rounding), and every method equals it bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

import torch

from .drafters.base import Draft
from .errors import InvalidField
from .host import cache_dir, write_json
from .sampling import argmax

FORMAT = 4  # 2: measured after several context lengths; 3: and up to which context (max_context); 4: pad_rows,
# and passes at both parities of the cache length
PAD_ROWS, PAD_COST = 2, 1.03  # the padding tried, and the most it may cost a 1-token step (time ratio)
# pass sizes measured after CONTEXTS; then they are checked after each of LONG_CONTEXTS until one fails
CONTEXTS, LONG_CONTEXTS, STEPS, MAX_SIZE = (48, 8, 20, 100, 200), (400, 800, 1600, 3200), 16, 16


@dataclass(frozen=True)
class ExactLimits:
    max_pass: int  # the largest pass (the root token plus guesses) whose rows all equal plain decoding's bits
    trees: bool  # a tree pass, its acceptance (a rejected node below the accepted one) and the steps after are exact
    checked: str = ""  # what was measured, for reports
    # the most cache cells up to which max_pass and trees were found exact; beyond it, 1-token passes (plain decoding).
    # llama.cpp: a 1-token flash-attention pass over 512+ cells splits the cache across threads and sums the
    # parts, a longer pass does not (ggml-cpu ops.cpp, use_split_kv_path); so 2-3 token passes stop being exact
    max_context: int = 0
    pad_rows: int = 1  # every target pass padded to this many rows (LM.pad_rows); 1: none

    @property
    def max_guesses(self) -> int:
        return self.max_pass - 1

    def guesses(self, cells: int) -> int:
        """Guesses one pass may carry with `cells` cache cells in use."""
        return self.max_guesses if cells + self.max_pass <= self.max_context else 0


class ExactDrafter:
    """A generation's drafter within the exact pass sizes: each step drafts no deeper than the guesses one pass may
    carry at the cache's size (none past max_context), and its draft is cut to them (to a chain where trees are not
    exact). The loop runs it as any drafter."""

    def __init__(self, drafter, limits: ExactLimits, target):
        self.drafter, self.limits, self.target = drafter, limits, target
        self._asked = False  # whether this step asked the drafter: it is told the verdict only then

    def reset(self) -> None:
        self.drafter.reset()

    def prefill(self, ids: list[int]) -> None:
        self.drafter.prefill(ids)

    def propose(self, ids: list[int], gamma: int, params, generator=None) -> Draft:
        cap = self.limits.guesses(self.target.cells())
        gamma = min(gamma, cap)
        self._asked = gamma > 0
        draft = self.drafter.propose(ids, gamma, params, generator) if self._asked else Draft([], None)
        return draft.prefix(cap, chain=not self.limits.trees)

    def commit(self, length: int, path: list[int], bonus: int) -> None:
        if self._asked:
            self.drafter.commit(length, path, bonus)


def _plain(lm, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens after prompt, one pass each: (tokens, logits after each [n, V])."""
    lm.reset()
    out = lm.forward(prompt, last_only=True)
    ids, rows = [], []
    for _ in range(n):
        t = argmax(out[-1])
        ids.append(t)
        out = lm.forward([t])
        rows.append(out[0].clone())
    return ids, torch.stack(rows)


def _chunked(lm, prompt: list[int], ids: list[int], k: int, offset: int = 0) -> torch.Tensor:
    """Rows of ids fed `offset` one per pass, then k per pass."""
    lm.reset()
    lm.forward(prompt, last_only=True)
    return torch.cat(
        [lm.forward(ids[a : a + 1]) for a in range(offset)]
        + [lm.forward(ids[a : a + k]) for a in range(offset, len(ids), k)]
    )


def _tree_rounds(lm, prompt: list[int], ids: list[int], size: int) -> torch.Tensor:
    """Rows of ids fed as trees of `size` nodes (size >= 3): root, a decoy child, the true child (and,
    with room, true grandchildren); the true branch is accepted, the decoy below it rejected; then the
    rest one token at a time."""
    lm.reset()
    lm.forward(prompt, last_only=True)
    rows, i = [], 0
    depth = size - 2  # true tokens after the root
    while i + depth + 1 <= len(ids) - 2:
        P = len(lm.ids)
        decoy = (ids[i + 1] + 1) % lm.vocab_size
        toks = [ids[i], decoy] + ids[i + 1 : i + 1 + depth]
        parents = [P - 1, P, P] + [P + 2 + a for a in range(depth - 1)]
        out = lm.forward(toks, parents=parents)
        rows += [out[0]] + [out[2 + a] for a in range(depth)]
        lm.rollback(P + 1, [P + 2 + a for a in range(depth)])
        i += depth + 1
    for t in ids[i:]:
        rows.append(lm.forward([t])[0])
    return torch.stack(rows)


def _exact_at(lm, prompt: list[int], steps: int, max_pass: int, trees: bool) -> tuple[int, bool]:
    """(the largest pass size up to max_pass whose rows equal plain decoding's, and whether trees stay exact) after
    prompt."""
    ids, ref = _plain(lm, prompt, steps)
    ok = 1
    for k in range(2, max_pass + 1):
        # k-token passes starting at an even and at an odd position: a kernel may split its work by the cache's
        # length (torch's CPU attention, with 2-row padding: exact at one parity only)
        if not all(torch.equal(_chunked(lm, prompt, ids, k, offset), ref) for offset in (0, 1)):
            break
        ok = k
    return ok, trees and ok >= 3 and lm.tree_error() is None and torch.equal(
        _tree_rounds(lm, prompt, ids, min(ok, 5)), ref
    )


def measure(lm, steps: int = STEPS, max_size: int = MAX_SIZE, pad_rows: int = 1) -> ExactLimits:
    """Measure the exact pass sizes of this LM after each of CONTEXTS random tokens (those that fit; seconds: about
    (max_pass + 2) short decodings per context), then up to which context they hold (LONG_CONTEXTS, until one
    fails: max_context is the last one that held, plus the steps decoded after it). A kernel's blocking can follow
    the context length: a pass size exact after some context lengths may not be after others, on torch and on
    llama.cpp (measured: docs/results/notes.md#code-exact-context; see ExactLimits.max_context).
    pad_rows: every pass (plain decoding's steps included) padded to that many rows (LM.pad_rows)."""
    with padding(lm, pad_rows):
        return _measure(lm, steps, max_size, pad_rows)


@contextmanager
def padding(lm, rows: int):
    """Every pass of lm padded to `rows` rows inside the block (LM.pad_rows), none after it, however it ends."""
    lm.pad_rows = rows
    try:
        yield
    finally:
        lm.pad_rows = 1


def _random_ids(lm, n: int, g: torch.Generator) -> list[int]:
    return torch.randint(0, min(lm.vocab_size, 30000), (n,), generator=g).tolist()


def _measure(lm, steps: int, max_size: int, pad_rows: int) -> ExactLimits:
    g = torch.Generator().manual_seed(0)
    rand = lambda n: _random_ids(lm, n, g)  # noqa: E731
    max_pass, trees, seen = max_size, True, []
    for n in CONTEXTS:
        if n + steps + max_size > lm.max_length and seen:
            break
        max_pass, trees = _exact_at(lm, rand(n), steps, max_pass, trees)
        seen.append(n)
    for n in LONG_CONTEXTS if max_pass > 1 else ():
        if n + steps + max_size > lm.max_length or _exact_at(lm, rand(n), steps, max_pass, trees) != (max_pass, trees):
            break
        seen.append(n)
    lm.reset()
    max_context = max(seen) + steps
    padded = f", every pass padded to {pad_rows} rows" if pad_rows > 1 else ""
    return ExactLimits(
        max_pass,
        bool(trees),
        f"{steps} greedy steps after {', '.join(map(str, seen))} random "
        f"tokens, passes of 2..{max_size} tokens and trees of up to {min(max_pass, 5)} nodes{padded}, "
        f"compared bit for bit; exact up to {max_context} cells",
        max_context,
        pad_rows,
    )


def padding_cost(lm, rows: int = PAD_ROWS, context: int = 128, rounds: int = 20) -> float:
    """A 1-token step padded to `rows` rows against an unpadded one, after `context` cached tokens: the ratio of the
    fastest of each, the two alternated (1.0: free). The fastest, not the median: a GPU's steps here are bound by
    kernel launches whose jitter would decide the choice by chance (docs/results/notes.md#code-padding-cost)."""
    lm.reset()
    lm.forward(_random_ids(lm, context, torch.Generator().manual_seed(1)), last_only=True)
    times: dict[int, list[float]] = {1: [], rows: []}
    for i in range(2 * rounds + 2):
        r = (1, rows)[i % 2]
        with padding(lm, r):
            t = time.perf_counter()
            lm.forward([i % 100 + 10])
            lm.synchronize()
            if i >= 2:  # the first of each out: warm-up
                times[r].append(time.perf_counter() - t)
            lm.rollback(context)
    lm.reset()
    return min(times[rows]) / min(times[1])


def choose(lm) -> ExactLimits:
    """The exact pass sizes as the LM runs; where none beyond 1 token and the backend pads, those of padded
    passes instead, if padding makes longer passes exact and costs a step at most PAD_COST."""
    found = measure(lm)
    if found.max_pass > 1 or not lm.can_pad:
        return found
    cost = padding_cost(lm)
    if cost > PAD_COST:
        return replace(found, checked=found.checked + f"; padding to {PAD_ROWS} rows not tried (a step {cost:.2f}x)")
    padded = measure(lm, pad_rows=PAD_ROWS)
    if padded.max_pass <= 1:
        return replace(found, checked=found.checked + f"; padded to {PAD_ROWS} rows: no longer pass exact either")
    return replace(padded, checked=padded.checked + f" (unpadded: 1 token; a padded step {cost:.2f}x)")


def limits(lm, progress: bool = False) -> ExactLimits:
    """The measured ExactLimits of this LM, read from the cache or measured once and stored."""
    if not lm.exact:
        raise InvalidField(
            f"exact mode needs a target loaded for it ({lm.backend} model {lm.name}: load it with "
            "exact=True / --exact; on llama.cpp that turns flash attention on)",
            param="exact",
        )
    key = hashlib.sha256(f"{FORMAT}|{lm.describe()}".encode()).hexdigest()[:16]
    path = cache_dir() / "exact" / f"{key}.json"
    try:
        return ExactLimits(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    if progress:
        print("[specdecode] measuring which pass sizes are bit-exact on this machine (once)...", flush=True)
    found = choose(lm)
    write_json(path, asdict(found))
    return found
