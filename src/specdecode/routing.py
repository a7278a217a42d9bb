"""The engine that suits the request: one GGUF model loaded twice, on llama.cpp (quantized kernels: the
cheapest plain step on a CPU) and on torch in bf16 (where the CPU's matrix units make a pass over 16 tokens
cost about one plain step, and a prompt is read several times faster). Each request runs whole, from its first
token to its last, on the engine whose measured costs predict it ends first, so its output is that engine's
target distribution; greedy answers of the two engines can differ at near-ties, as passes of different sizes
can on one engine. Exact mode, and the methods that need the draft model, stay on llama.cpp. The choice reads the
prompt and the prediction, never `max_new_tokens`: a request cut shorter runs on the same engine, with the same
numerics, as the longer one. A request may pin an engine (`engine=`).

    >>> router = Router.load()                 # `--route`: llama.cpp, plus torch where it pays here
    >>> out = router.generate(prompt, prediction=old_file)
    >>> out.stats.engine                       # the engine that served it: "llama.cpp" or "torch"
    >>> router.generate(prompt, engine="llama.cpp")  # pinned: the same numerics for every request

Torch joins only where a bf16 matrix product over 16 rows measures at most FLAT_RATIO times one over a single
row on this machine (`flat_ratio`: timed, never assumed from the CPU's name) and memory allows the bf16 copy.
"""

from __future__ import annotations

import json
import os
import time

import torch

from .backends import compute, torch_copy_bytes
from .engine import Engine
from .errors import InvalidField, SpecDecodeError
from .host import cache_dir, memory_available, write_json
from .methods import METHOD_TABLE, get_method
from .planning.costs import machine_key
from .request import Request

FLAT_RATIO = 1.5  # torch joins where a 16-row bf16 product costs at most this many 1-row ones
COPY_ALPHA = 0.95  # per-token acceptance a request with a prediction is planned with (an edit: a few edit points)
DEFAULT_NEW = 256  # tokens a request without a prediction is priced at (its max_new_tokens is not read)
READ_TOKENS = 256  # the prompt read per engine to price prompts (seconds per prompt token)
READ_REPEATS = 3  # its best of this many reads is kept: one read beside other work would stay cached, too slow


def flat_ratio(rows: int = 16, d: int = 1536, ff: int = 4096, repeats: int = 5) -> float:
    """Seconds of a bf16 [rows, d] x [d, ff] product over those of a [1, d] one (the shape of a 1.5B model's MLP):
    about 1 where the CPU has matrix units for bf16 (AMX), about `rows` where it computes row by row."""
    w = torch.randn(d, ff, dtype=torch.bfloat16)
    best = {}
    for n in (1, rows):
        x = torch.randn(n, d, dtype=torch.bfloat16)
        for _ in range(2):
            x @ w  # warm-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(8):
                x @ w
            times.append(time.perf_counter() - t)
        best[n] = min(times)
    return best[rows] / best[1]


def read_seconds(engine: Engine, tokens: int = READ_TOKENS, remeasure: bool = False) -> float:
    """Seconds per prompt token on this engine: the best of READ_REPEATS reads of a `tokens`-token prompt (cached
    per machine; `remeasure`: read again)."""
    key = f"{machine_key(engine.target)}-{tokens}"  # the pass costs' key: machine, model, threads
    path = cache_dir() / "routing" / f"{key}.json"
    if path.exists() and not remeasure:
        try:
            raw = json.loads(path.read_text())
            if raw.get("key") == key and raw["read_s"] > 0:
                return raw["read_s"]
        except (ValueError, KeyError, TypeError):
            pass
    lm = engine.target
    tokens = min(tokens, lm.max_length - 1)
    prompt = [(7 * i + 11) % min(1000, lm.vocab_size) for i in range(tokens)]
    times = []
    with engine.lease.held("timing a prompt read"):
        for _ in range(READ_REPEATS):
            lm.reset()
            t = time.perf_counter()
            lm.forward(prompt, last_only=True)
            lm.synchronize()
            times.append((time.perf_counter() - t) / tokens)
        lm.reset()
    seconds = min(times)
    write_json(path, {"key": key, "read_s": seconds})
    return seconds


def tokens_per_second(costs, context: int, alpha: float, gamma: int | None = None) -> float:
    """The best decoding rate on these pass costs at this context: plain steps (alpha 0), or chains of k guesses
    each taken with probability alpha (Leviathan et al.'s expected tokens, the measured T(k+1)). gamma: a method
    that drafts gamma guesses a pass whatever they cost (pld) is priced at that depth alone."""
    c = costs.at(context)
    if gamma is not None and alpha > 0:
        return (1 - alpha ** (gamma + 1)) / (1 - alpha) / c.t(gamma + 1)
    best = 1.0 / c.t(1)
    if alpha > 0:
        for k in sorted(c.target):
            if k < 2:
                continue
            tokens = (1 - alpha**k) / (1 - alpha)  # k - 1 guesses and the bonus
            best = max(best, tokens / c.t(k))
    return best


class Router:
    """Engines on the same model; `stream`/`generate` run each request on the one predicted to end first.
    Everything else (tokenizer, checks, the target's context, history, costs) is the first engine's."""

    def __init__(self, engines: dict[str, Engine], remeasure: bool = False):
        if not engines:
            raise SpecDecodeError("a router needs at least one engine")
        self.engines = engines
        self.primary = next(iter(engines.values()))
        self.read_s = (
            {n: compute.call(read_seconds, e, READ_TOKENS, remeasure) for n, e in engines.items()}
            if len(engines) > 1
            else {}
        )
        self.choices: dict[str, int] = {name: 0 for name in engines}

    @property
    def backend(self) -> str:
        return " + ".join(self.engines)

    def __getattr__(self, name):  # the primary engine's attributes (tokenizer, target, history, check, ...)
        return getattr(self.__dict__["primary"], name)

    @classmethod
    def load(
        cls,
        target=None,
        draft=None,
        *,
        backend: str = "auto",
        dtype=None,
        device=None,
        progress: bool = True,
        threads=None,
        exact: bool = False,
        remeasure: bool = False,
        **kwargs,
    ):
        """llama.cpp's engine, and beside it the same target on torch in bf16 where its passes measure flat here
        and memory allows, outside exact mode (which keeps every request on llama.cpp); a Router either way (with
        one engine it only forwards). remeasure: time this machine again (the bf16 probe, the prompt reads)
        instead of reading the cached results. Other arguments: Engine.load's."""
        if backend not in ("auto", "llama.cpp") or dtype is not None or device not in (None, "cpu"):
            raise SpecDecodeError(
                "--route runs a GGUF target on llama.cpp and on torch bf16, on the CPU: --backend, "
                "--dtype and --device do not apply"
            )
        primary = Engine.load(
            target, draft, backend="llama.cpp", progress=progress, threads=threads, exact=exact, **kwargs
        )
        engines = {"llama.cpp": primary}
        why = "exact mode runs every request on llama.cpp" if exact else torch_unsuited(primary, remeasure)
        if why is None:  # loaded, measured and run on the compute thread: torch and llama.cpp share one OpenMP pool
            engines["torch"] = compute.call(
                lambda: Engine.load(
                    target,
                    None,
                    backend="torch",
                    dtype="bf16",
                    with_draft=False,
                    progress=progress,
                    threads=threads,
                    history_tokens=kwargs.get("history_tokens", 0),
                    datastore=kwargs.get("datastore"),
                )
            )
            compute.call(engines["torch"].tree_costs)  # measured now (once per machine), not in the first request
        elif progress:
            print(f"--route: llama.cpp only ({why})", flush=True)
        primary.tree_costs()
        return cls(engines, remeasure)

    def predict_s(
        self, name: str, prompt_tokens: int, new_tokens: int, alpha: float, gamma: int | None = None
    ) -> float:
        """Seconds this request should take on engine `name`: its prompt read, then its tokens decoded (gamma: see
        tokens_per_second)."""
        costs = self.engines[name].tree_costs()
        rate = tokens_per_second(costs, prompt_tokens + new_tokens // 2, alpha, gamma)
        return self.read_s.get(name, 0.0) * prompt_tokens + new_tokens / rate

    def choose(self, prompt_tokens: int, new_tokens: int, alpha: float, gamma: int | None = None) -> str:
        if len(self.engines) == 1:
            return next(iter(self.engines))
        return min(self.engines, key=lambda n: self.predict_s(n, prompt_tokens, new_tokens, alpha, gamma))

    def separate_encoder(self, copies: int = 1) -> None:
        for engine in self.engines.values():
            engine.separate_encoder(copies)

    def stream(self, prompt, engine: str | None = None, **kwargs):
        """Engine.stream's arguments; `engine` pins the engine that runs it (default: the one predicted to end
        first)."""
        return self.open(Request(prompt, engine=engine, **kwargs))

    def open(self, request: Request):
        """The request opened on the engine it should run on, tokenized once by the first engine (they share its
        tokenizer): the choice reads those ids, and the engine chosen opens them."""
        first = next(iter(self.engines))
        exact = request.exact or (request.exact is None and self.primary.exact)
        on_first = exact or not get_method(request.method).routable
        pinned = request.engine
        if pinned is not None:
            if pinned not in self.engines:
                raise InvalidField(
                    f"engine {pinned!r} is not loaded here; the engines are {' and '.join(map(repr, self.engines))}",
                    param="engine",
                )
            if on_first and pinned != first:
                why = "exact mode" if exact else f"method {request.method!r}"
                raise InvalidField(f"engine {pinned!r} cannot run {why}, which runs on {first!r} only", param="engine")
        encoded = self.primary.encode_request(request)
        name = pinned or first
        if pinned is None and not on_first and len(self.engines) > 1:
            prediction = encoded.prediction_ids
            # priced by what the request is expected to write, not by max_new_tokens: the cap must not move a request
            # to the other engine, whose greedy text can differ at near-ties
            drafts = METHOD_TABLE[request.method].drafts and bool(prediction)
            new = len(prediction) if prediction else DEFAULT_NEW
            gamma = request.gamma if METHOD_TABLE[request.method].uses_gamma else None  # pld: its depth
            name = self.choose(len(encoded.prompt_ids), new, COPY_ALPHA if drafts else 0.0, gamma)
        stream = self.engines[name].open(encoded)
        if len(self.engines) > 1:
            stream.wrap_steps(compute.steps_on)  # one OpenMP pool for both engines (backends/compute.py)
        stream.stats.engine = name
        self.choices[name] += 1
        return stream

    def generate(self, prompt, **kwargs):
        stream = self.stream(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.result


def probed_flat_ratio(engine: Engine, remeasure: bool = False) -> float:
    """flat_ratio on this machine, timed once and kept under the cache directory, keyed by the machine and the
    target (as the prompt reads); `remeasure`: time it again."""
    key = machine_key(engine.target)
    path = cache_dir() / "routing" / f"flat-{key}.json"
    if path.exists() and not remeasure:
        try:
            raw = json.loads(path.read_text())
            if raw.get("key") == key and raw["flat_ratio"] > 0:
                return raw["flat_ratio"]
        except (ValueError, KeyError, TypeError):
            pass  # a damaged file: measure again
    ratio = flat_ratio()
    write_json(path, {"key": key, "flat_ratio": ratio})
    return ratio


def torch_unsuited(engine: Engine, remeasure: bool = False) -> str | None:
    """Why the torch bf16 engine should not join on this machine (None: it should)."""
    if os.environ.get("SPECDECODE_ROUTE_FORCE") == "1":  # tests and measurements on any machine
        return None
    ratio = probed_flat_ratio(engine, remeasure)
    if ratio > FLAT_RATIO:
        return (
            f"a bf16 product over 16 rows costs {ratio:.1f}x one over 1 row here; torch joins at {FLAT_RATIO}x or less"
        )
    n, path = getattr(engine.target, "n_params", None), getattr(engine.target, "path", None)
    need = torch_copy_bytes(path, n) if n and path else None  # the first load converts the file: its peak counts
    free = memory_available()
    if need is not None and free is not None and free < 1.25 * need:
        return f"loading the bf16 copy needs about {need / 2**30:.1f} GiB; {free / 2**30:.1f} GiB is available"
    return None


def loader(route: bool):
    """What a front end loads its models with: Engine.load, or with --route Router.load (the same arguments)."""
    return Router.load if route else Engine.load
