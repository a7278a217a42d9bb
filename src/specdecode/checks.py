"""A generation request's arguments, checked without models (Engine.check: front ends call it before
loading them)."""
from __future__ import annotations

from .errors import SpecDecodeError
from .methods import METHOD_TABLE, get_method
from .sampling import SamplingParams
from .textstream import STOP_CHARS_MAX


def check_request(*, method: str = "auto", gamma: int = 4, max_new_tokens: int = 128, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, stop=None, tree_width=None, tree_depth=None,
                  tree_nodes=None) -> SamplingParams:
    """SpecDecodeError with a message for the first bad argument; the sampling settings otherwise."""
    params = SamplingParams(temperature, top_k, top_p)
    m = get_method(method)  # SpecDecodeError naming the choices
    for name, value in (("gamma", gamma), ("max_new_tokens", max_new_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise SpecDecodeError(f"{name} must be a positive integer, got {value!r}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) and s for s in stops):
        raise SpecDecodeError("stop strings must be non-empty strings")
    if sum(map(len, stops)) > STOP_CHARS_MAX:
        raise SpecDecodeError(f"stop strings must hold at most {STOP_CHARS_MAX} characters in all, "
                              f"got {sum(map(len, stops))}")
    for name, value in (("tree_width", tree_width), ("tree_depth", tree_depth), ("tree_nodes", tree_nodes)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise SpecDecodeError(f"{name} must be a positive integer, got {value!r}")
        if value is not None and not m.tree_options:
            takes = " or ".join(repr(n) for n, t in METHOD_TABLE.items() if t.tree_options)
            raise SpecDecodeError(f"{name} applies to method {takes} only (method is {method!r})")
    return params
