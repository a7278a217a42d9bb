"""What a forward pass costs, and how often a drafted token is accepted: the numbers a token tree
is shaped by.

CostModel: seconds for one target pass over n tokens and one draft pass over k tokens, measured
once per machine, model, dtype, device and thread count, and cached as JSON under the cache dir.
(Calibration, the acceptance learned online, lives in calibration.py and is re-exported here.)
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path

from .calibration import Calibration  # noqa: F401  (re-exported)

TARGET_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
DRAFT_SIZES = (1, 2, 4, 8)
CONTEXT = 128  # tokens already cached when timing: a typical prompt


@dataclass
class CostModel:
    target: dict[int, float]  # tokens in one target pass -> seconds
    draft: dict[int, float] = field(default_factory=dict)  # tokens in one draft pass -> seconds

    def t(self, n: int) -> float:
        return _interpolate(self.target, n)

    def d(self, k: int) -> float:
        return _interpolate(self.draft, k) if self.draft else 0.0

    def as_dict(self) -> dict:
        """Costs relative to one plain decoding step (a 1-token target pass)."""
        one = self.t(1)
        return {"target_s_1": one, "target": {n: s / one for n, s in self.target.items()},
                "draft": {k: s / one for k, s in self.draft.items()}}


def _interpolate(table: dict[int, float], n: int) -> float:
    xs = sorted(table)
    if n <= xs[0]:
        return table[xs[0]] * n / xs[0]
    i = min(bisect_left(xs, n), len(xs) - 1)
    a, b = xs[i - 1], xs[i]
    return table[a] + (table[b] - table[a]) * (n - a) / (b - a)  # beyond the last point: extrapolate


def measure(lm, sizes, repeats: int = 3, progress=None, stop_at: float = 8.0) -> dict[int, float]:
    """Seconds of one pass over n new tokens after CONTEXT cached ones: the fastest of `repeats`
    rounds (round-robin over the sizes, so a burst of noise does not hit one size only), made
    non-decreasing in n. Sizes past stop_at x the 1-token cost are not measured (extrapolated)."""
    vocab = min(1000, lm.vocab_size)
    context = [(7 * i + 11) % vocab for i in range(CONTEXT)]
    best: dict[int, float] = {}
    lm.reset()
    lm.forward(context, last_only=True)
    for n in sizes[:2]:  # warm-up
        lm.forward([1] * n)
        lm.rollback(CONTEXT)
    for r in range(repeats):
        for n in sizes:
            if r and n not in best:
                continue
            if best and best[sizes[0]] * stop_at < best.get(n, 0.0):
                continue
            lm.rollback(CONTEXT)
            t = time.perf_counter()
            lm.forward([1] * n)
            lm.synchronize()
            best[n] = min(best.get(n, float("inf")), time.perf_counter() - t)
            if progress is not None:
                progress.update(1)
            if r == 0 and best[n] > best[sizes[0]] * stop_at:
                break
    lm.reset()
    out, running = {}, 0.0
    for n in sorted(best):
        running = max(running, best[n])
        out[n] = running
    return out


def machine_key(*lms) -> str:
    parts = [platform.machine(), platform.processor(), _cpu_name()] + [lm.describe() for lm in lms]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def load_or_measure(target_lm, draft_lm=None, progress: bool = True) -> CostModel:
    from .models import cache_dir
    path = cache_dir() / "costs" / f"{machine_key(*(lm for lm in (target_lm, draft_lm) if lm is not None))}.json"
    if path.exists():
        try:
            raw = json.loads(path.read_text())
            tables = [{int(k): float(v) for k, v in raw[name].items()} for name in ("target", "draft")]
            if tables[0] and all(v > 0 for t in tables for v in t.values()) and (bool(tables[1]) == (draft_lm is not None)):
                return CostModel(*tables)
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # a damaged file: measure again
    from tqdm.auto import tqdm
    sizes = [n for n in TARGET_SIZES if n + CONTEXT < target_lm.max_length]
    dsizes = [k for k in DRAFT_SIZES if draft_lm is not None and k + CONTEXT < draft_lm.max_length]
    with tqdm(total=3 * (len(sizes) + len(dsizes)), desc="measuring pass costs (once per machine)",
              disable=not progress, leave=False) as bar:
        costs = CostModel(measure(target_lm, sizes, progress=bar),
                          measure(draft_lm, dsizes, progress=bar) if dsizes else {})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"target": costs.target, "draft": costs.draft}, indent=1))
    tmp.replace(path)
    return costs
