"""A generation request's arguments, checked without models (Engine.check: front ends call it before
loading them), and the positive-integer check every layer uses (positive_int, from errors.py). Torch-free, and so
is what check_request imports: the command line checks a request before torch loads, and the load test uses
positive_int. A tree's size against what the models hold is checked where its drafter is built (builders.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import InvalidField, positive_int
from .methods import DEFAULT_GAMMA, DEFAULT_METHOD

if TYPE_CHECKING:
    from .params import SamplingParams

STOP_CHARS_MAX = 4096  # characters of stop strings one generation may ask for, all together


def check_request(
    *,
    method: str = DEFAULT_METHOD,
    gamma: int = DEFAULT_GAMMA,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop=None,
    tree_width=None,
    tree_depth=None,
    tree_nodes=None,
) -> SamplingParams:
    """InvalidField naming the first bad argument; the sampling settings otherwise."""
    from .methods import METHOD_TABLE, get_method
    from .params import SamplingParams

    params = SamplingParams(temperature, top_k, top_p)
    m = get_method(method)  # SpecDecodeError naming the choices
    for name, value in (("gamma", gamma), ("max_new_tokens", max_new_tokens)):
        positive_int(name, value)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) and s for s in stops):
        raise InvalidField("stop strings must be non-empty strings", param="stop")
    if sum(map(len, stops)) > STOP_CHARS_MAX:
        raise InvalidField(
            f"stop strings must hold at most {STOP_CHARS_MAX} characters in all, got {sum(map(len, stops))}",
            param="stop",
        )
    for name, value in (("tree_width", tree_width), ("tree_depth", tree_depth), ("tree_nodes", tree_nodes)):
        if value is not None:
            positive_int(name, value)
        if value is not None and not m.tree_options:
            takes = " or ".join(repr(n) for n, t in METHOD_TABLE.items() if t.tree_options)
            raise InvalidField(f"{name} applies to method {takes} only (method is {method!r})", param=name)
    return params
