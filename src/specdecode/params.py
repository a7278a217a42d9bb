"""A request's sampling settings, checked where they are made. Torch-free: the command line and the server check a
request before anything loads torch or a model (checks.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import InvalidField


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise InvalidField(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}", param="temperature")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise InvalidField(f"top_k must be an integer >= 0 (0 = off), got {k!r}", param="top_k")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            raise InvalidField(f"top_p must be in (0, 1], got {p!r}", param="top_p")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
