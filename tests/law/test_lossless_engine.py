"""Losslessness through the WHOLE engine: every shipped sampled method emits the target's own law.

test_verify_stats / test_verify_tree check the acceptance rules on synthetic probability tensors.
Here the same kind of chi-square test runs on real generations: `Engine.stream` with real tiny torch
models (tests/tiny.py, 1 layer, hidden 16, a vocabulary of V = 8 tokens and no EOS) and their real KV
caches (`CachedLM`, DynamicCache), so that the drafters, the adaptive tree planner and its cost model,
`verify` / `verify_tree`, the rollback of both caches and the stats all run, unmodified, for every
sample. For each method (`draft` with gamma=2, `pld`, `tree` with the planner on a cheap-verification
cost table, `auto` with a table on which the draft model pays, and at top-k 3 also with one on which it
does not) and each sampling setting (temperature 1; top-k 3; top-p 0.7; pld at temperature 1 only, see
CASES), N = 10^5 generations of 3 new
tokens from a repetitive prompt (so prompt lookup proposes) are compared with the exact law of the
target's first 3 tokens, p(x1|prompt) p(x2|prompt,x1) p(x3|prompt,x1,x2), enumerated from fresh
prefills of the target through the engine's own transform (`probs_from_logits`). Three tokens with
max_new_tokens=3: the first pass drafts up to two deep, so rejections at depth 1 and 2, whole accepted
branches with their bonus token, and a second (and third) pass after each kind of rollback are all in
the law.

Checks per case: chi-square goodness of fit (test_verify_stats.gof_pvalue: impossible tokens fail
outright, small cells merged) of the first-token marginal, the pair and the triple; a p-value <= 1e-6
fails. Speculation must really have happened: the first target pass verified drafted tokens in
(almost) every sample, drafted tokens were accepted and rejected in a large share of the samples, and
the drafts have the shape the case is about (prompt-lookup nodes, drawn trees with siblings, chains).
Every case has a negative control, the same harness with a deliberately wrong engine (a verifier that
accepts everything, a residual replaced by p, tree siblings tried without the residual update, a
drafter that prunes drawn nodes by their drawn value), which must be rejected (p-value < 1e-6).

Wall time. Every generation runs the real engine code: on a 2-core AMD EPYC Zen 3 VM that is 1.1-2.6
ms of Python and small torch ops per generation (pld 1.1, draft 1.8, auto 1.8, lookup 1.9, tree 2.6;
one core with the other busy), even with the transformer itself replayed: `ReplayModel` wraps the HF
model (not CachedLM) and memoises its forward by (the exact bytes of every cached key/value, the fed ids,
mask and positions).
On a hit it returns the stored logits and appends the stored keys/values to the real DynamicCache, so
CachedLM's own crop/gather rollback still runs on a real cache. The model is deterministic, so a replay
is bit-identical to a real pass (test_replay_model_is_bit_identical checks logits and cache contents on
random chains, tree passes, trees on unrolled trees and branch gathers). Samples are split across the
CPU cores by fork: each sample's seed, not its process, decides its output, so the counts do not
depend on the split. With N = 10^5 its 15 cases take 54 CPU-minutes there (one pytest process on one
core); ENGINE_STATS_N=20000 takes about 4 (and the chi-square then detects only biases sqrt(5) larger).
"""

from __future__ import annotations

import os
import pickle
import random
import time
import traceback
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers.cache_utils import Cache

import specdecode.builders as builders_mod
import specdecode.verify as verify_mod  # noqa: E402  (verify.verdict calls verify, verify_tree from here)
from helpers import accept_everything, gof_pvalue, no_residual_update, residual_is_p
from specdecode import Engine, SamplingParams
from specdecode.backends import CachedLM
from specdecode.planning.costs import CostModel
from specdecode.planning.tree import TreeDrafter, draft_model_can_pay
from specdecode.sampling import probs_from_logits
from specdecode.verify import verify as real_verify
from tiny import tiny_model

ALPHA = 1e-6  # a p-value at or below this is a failure
# generations per case (see "Wall time" above for what 10^5 costs)
N = int(os.environ.get("ENGINE_STATS_N", 100_000))
N_CONTROL = 2_000  # generations per negative control (each one's p-value is < 1e-7 at 1000 already)
V = 8  # vocabulary of the tiny models
NEW = 3  # tokens per generation; the joint law of all of them is tested
CHARS = "abcdefgh"


# ============================================================= the models, replayed


class ReplayModel:
    """A Hugging Face causal LM whose forward passes are memoised: a pass is a deterministic function of
    what the KV cache holds and of what is fed (ids, attention mask, positions, logits_to_keep), so the
    key is the exact bytes of all of those. A miss runs the real model (which appends to the cache) and
    stores its logits and the keys/values it appended; a hit returns a copy of the stored logits and
    appends the stored keys/values to the given cache through DynamicCache.update, exactly what the
    model's attention layers do. Everything else (config, parameters, ...) is the wrapped model's, so
    CachedLM drives it as it drives any HF model."""

    def __init__(self, model):
        self.model, self.table = model, {}
        self.hits = self.misses = 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    @staticmethod
    def _layers(cache: Cache):
        return [
            (layer.keys, layer.values) if getattr(layer, "keys", None) is not None and layer.keys.numel() else None
            for layer in cache.layers
        ]

    def __call__(self, **kwargs):
        cache = kwargs.get("cache")
        assert isinstance(cache, Cache), "ReplayModel expects the KV cache as the keyword argument `cache`"
        # the key: every argument, tensors by shape, dtype and exact bytes (written out, not looped over
        # generically: this runs several times per generation, 10^5 generations per case)
        key = [
            tuple(
                None if kv is None else (kv[0].shape, kv[0].numpy().tobytes(), kv[1].numpy().tobytes())
                for kv in self._layers(cache)
            )
        ]
        for name, v in sorted(kwargs.items()):
            if isinstance(v, torch.Tensor):
                key.append((name, v.shape, v.dtype, v.numpy().tobytes()))
            elif name != "cache":
                key.append((name, v))
        key = tuple(key)
        hit = self.table.get(key)
        if hit is None:
            self.misses += 1
            n = kwargs["input_ids"].shape[-1]
            before = [0 if kv is None else kv[0].shape[-2] for kv in self._layers(cache)]
            out = self.model(**kwargs)
            after = self._layers(cache)
            assert [kv[0].shape[-2] for kv in after] == [b + n for b in before], "the cache must grow by the fed tokens"
            hit = (out.logits.clone(), [(k[..., -n:, :].clone(), v[..., -n:, :].clone()) for k, v in after])
            self.table[key] = hit
        else:
            self.hits += 1
            for i, (k, v) in enumerate(hit[1]):
                cache.update(k, v, i)
        return SimpleNamespace(logits=hit[0].clone())


class CharTokenizer:
    """V one-character tokens 'a'..'h', no special tokens: the Engine's text layer on a tiny vocabulary."""

    eos_token_id = None
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [CHARS.index(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(CHARS[i] for i in ids)

    def get_added_vocab(self):
        return {}

    def get_vocab(self):
        return {c: i for i, c in enumerate(CHARS)}


def small_model(seed):
    return tiny_model(seed, vocab_size=V, layers=1, hidden=16, eos_token_id=None)


# ----------------------------------------------------------------- the replay is exact


def _random_session(model, rng: random.Random, steps: int = 80):
    """Random forwards (chains, last_only, trees) and rollbacks (crops and accepted branches, gathered
    out of a tree) on a CachedLM; returns everything observable: the logits, ids and cache contents
    after every operation. The tree structure is tracked here (par[i]: the cache index entry i follows)."""
    lm = CachedLM(model)
    par: list[int] = []
    seen, ops = [], Counter()
    for _ in range(steps):
        op = rng.random()
        if op < 0.05 or len(lm) > 40:
            lm.reset()
            par = []
            seen.append(("reset",))
            continue
        start = len(lm)
        unrolled = any(par[i] != i - 1 for i in range(1, len(par)))  # a tree pass not rolled back yet
        if op < 0.4 or start == 0:  # a chain (a prefill, a plain step, or text after an unrolled tree)
            ids = [rng.randrange(V) for _ in range(rng.randint(1, 5))]
            logits = lm.forward(ids, last_only=rng.random() < 0.3)
            par += list(range(start - 1, start - 1 + len(ids)))
            ops["chain on tree"] += unrolled
            ops["passes"] += 1
        elif op < 0.7:  # a tree: a root continuing the text and nodes below it
            n = rng.randint(1, 7)
            parents = [start - 1] + [start + rng.randrange(j + 1) for j in range(n - 1)]
            logits = lm.forward([rng.randrange(V) for _ in range(n)], parents=parents)
            par += parents
            ops["tree on tree"] += unrolled
            ops["passes"] += 1
        else:  # keep a prefix that is plain text, then a branch hanging off its last entry
            plain = next((i for i in range(1, len(par)) if par[i] != i - 1), len(par))
            length = rng.randint(1, plain)
            tips = []
            for tip in range(length, len(par)):
                branch, a = [], tip
                while a >= length:
                    branch.append(a)
                    a = par[a]
                if a == length - 1:
                    tips.append(branch[::-1])
            path = rng.choice(tips) if tips and rng.random() < 0.8 else []
            lm.rollback(length, path)
            ops["gather"] += path != list(range(length, length + len(path)))
            par = par[:length] + list(range(length - 1, length - 1 + len(path)))
            logits = None
        assert len(par) == len(lm)
        layers = [
            (layer.keys.clone(), layer.values.clone())
            for layer in lm.cache.layers
            if getattr(layer, "keys", None) is not None
        ]
        seen.append((None if logits is None else logits.clone(), list(lm.ids), layers))
    return seen, ops


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y)
        if len(x) == 1:  # a reset
            continue
        assert (x[0] is None) == (y[0] is None)
        if x[0] is not None:
            assert torch.equal(x[0], y[0])  # bit-identical logits
        assert x[1] == y[1]
        assert len(x[2]) == len(y[2])
        for (k1, v1), (k2, v2) in zip(x[2], y[2]):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)  # bit-identical cache contents


def test_replay_model_is_bit_identical():
    model = small_model(0)
    replay = ReplayModel(model)
    seen = Counter()
    for seed in range(6):
        want, ops = _random_session(model, random.Random(seed))
        seen += ops
        # misses run the real model; hits replay states an earlier session met
        _assert_same(_random_session(replay, random.Random(seed))[0], want)
        hits = replay.hits
        _assert_same(_random_session(replay, random.Random(seed))[0], want)  # again: every pass replayed
        assert replay.hits - hits == ops["passes"]
    assert seen["gather"] > 5 and seen["tree on tree"] > 5 and seen["chain on tree"] > 5
    assert replay.misses > 100


# ============================================================= the cases

TARGET_SEED, DRAFT_SEED = 0, 1
# The target's greedy text falls into the loop "c h b d a d a d a ...": a repetitive prompt, so prompt
# lookup proposes (here "d a", the continuation of the last 3-gram), and the target often agrees.
PROMPT = "chbdadada"

SETTINGS = {
    "T1": dict(temperature=1.0),
    "topk3": dict(temperature=1.0, top_k=3),
    "topp0.7": dict(temperature=1.0, top_p=0.7),
}

# hand-made pass costs, relative to one plain step (no measuring: the cases must not depend on timing)
# verification is cheap (a 32-token pass costs 6 plain steps) and drafting too: wide trees (4-5 nodes here)
WIDE = CostModel({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.9, 16: 3.2, 32: 6.0}, {1: 0.05, 2: 0.06, 4: 0.07, 8: 0.1})
# verification grows quickly with width and drafting is cheap: the draft model pays, for narrow trees and chains
NARROW = CostModel({1: 1.0, 2: 1.15, 3: 1.45, 4: 1.8, 8: 3.5, 32: 13.0}, {1: 0.05, 2: 0.06, 4: 0.07, 8: 0.1})
# drafting costs about a plain step and a 2-token pass 1.3 (llama.cpp on 2 cores): the auto method never
# runs the draft model, and verifies one prompt-lookup guess (not two, as pld does) when its learned
# acceptance pays for the wider pass
NO_DRAFT = CostModel({1: 1.0, 2: 1.3, 3: 1.6, 4: 1.9, 8: 3.1, 32: 10.0}, {1: 0.9, 2: 1.0, 4: 1.1, 8: 1.5})

# method -> (Engine.stream keyword arguments, cost model)
METHODS = {
    "draft": (dict(method="draft", gamma=2), None),
    "pld": (dict(method="pld", gamma=2), None),
    "tree": (dict(method="tree"), WIDE),
    "auto": (dict(method="auto"), NARROW),
    "auto-lookup": (dict(method="auto"), NO_DRAFT),
    # the lookup drafter alone (no draft model): trees of deterministic guesses, several siblings per node
    # (from a datastore of random text and the engine's earlier outputs), planned on the cheap-verification table
    "lookup": (dict(method="lookup"), WIDE),
    # a draft whose output layer keeps 5 of the 8 tokens (FR-Spec): q is zero on f, g, h, which the target
    # still emits; its own engine (the truncation changes the draft model)
    "draft-frspec": (dict(method="draft", gamma=2), None),
    # a client's prediction ("dad": what the target's greedy text would be) followed as a copy: the first pass rides
    # it alone (a chain of one-hot guesses, chosen before anything is drawn); after a rejection the alignment is
    # lost and the draft model's drawn trees take over
    "auto-prediction": (dict(method="auto", prediction="dad"), WIDE),
}
FRSPEC_KEEP = [0, 1, 2, 3, 4]


def _lookup_sources(engine, monkeypatch, tmp_dir):
    """A datastore of random text over the tiny vocabulary (continuations branch) and an output history."""
    from specdecode.drafters import History, build_datastore, tokenizer_fingerprint

    rng = random.Random(5)
    docs = [[rng.randrange(V) for _ in range(rng.randint(5, 60))] for _ in range(60)]
    build_datastore(docs, tmp_dir / "ds", tokenizer_fingerprint(engine.tokenizer), vocab_size=V, progress=False)
    engine.use_datastore(str(tmp_dir / "ds"))
    monkeypatch.setattr(engine, "history", History(2000))


@pytest.fixture(scope="module")
def engine():
    tok = CharTokenizer()
    # the draft model sees a window of 4 tokens (drafters.model.DraftModel.window): its view is re-based
    # within these short generations, and the target's law must not notice
    eng = Engine(ReplayModel(small_model(TARGET_SEED)), tok, ReplayModel(small_model(DRAFT_SEED)), tok, draft_window=4)
    eng.progress = False
    return eng


@pytest.fixture(scope="module")
def frspec_engine():
    tok = CharTokenizer()
    eng = Engine(ReplayModel(small_model(TARGET_SEED)), tok, ReplayModel(small_model(DRAFT_SEED)), tok)
    eng.draft_model.truncate(FRSPEC_KEEP)
    eng.progress = False
    return eng


# ============================================================= the exact law


def exact_law(setting: str) -> np.ndarray:
    """P(x1, x2, x3 | PROMPT) [V, V, V], from fresh prefills of the (real) target, through the engine's
    own transform. Also checks that the transform's support is not decided by a near-tie (top-k: the
    k-th and (k+1)-th logits; top-p: the mass before a token against top_p), so that the few ulps by
    which a tree pass differs from a fresh prefill cannot move it."""
    params = SamplingParams(**SETTINGS[setting])
    model = small_model(TARGET_SEED)
    prompt = CharTokenizer()(PROMPT)["input_ids"]

    def dist(ids):
        logits = CachedLM(model).forward(ids, last_only=True)[-1]
        if params.top_k:
            top = logits.sort(descending=True).values
            assert top[params.top_k - 1] - top[params.top_k] > 1e-3, (ids, top)
        if params.top_p < 1:
            p = torch.softmax(logits / params.temperature, -1).double().sort(descending=True).values
            before = p.cumsum(0) - p
            assert (before - params.top_p).abs().min() > 1e-4, (ids, p)
        return probs_from_logits(logits, params).double().numpy()

    law = np.zeros((V,) * NEW)
    p1 = dist(prompt)
    for a in np.flatnonzero(p1):
        p2 = dist(prompt + [int(a)])
        for b in np.flatnonzero(p2):
            law[a, b] = p1[a] * p2[b] * dist(prompt + [int(a), int(b)])
    assert abs(law.sum() - 1) < 1e-6
    return law / law.sum()


_LAWS: dict[str, np.ndarray] = {}


def law_of(setting):
    if setting not in _LAWS:
        _LAWS[setting] = exact_law(setting)
    return _LAWS[setting]


def pvalues(counts: np.ndarray, law: np.ndarray) -> dict[str, float]:
    return {
        "first": gof_pvalue(counts.sum((1, 2)), law.sum((1, 2))),
        "pair": gof_pvalue(counts.sum(2), law.sum(2)),
        "triple": gof_pvalue(counts, law),
    }


# ============================================================= sampling through the engine

# (drawn nodes, lookup nodes, branching) of a generation's first TreeDrafter step
_DRAFTS: list[tuple[int, int, bool]] = []


def _spy_on_tree_drafts(monkeypatch):
    """Record what each tree step sent to the target (a transparent wrapper: the Draft is returned as is)."""
    real = TreeDrafter._draft
    if getattr(real, "is_spy", False):
        return

    def spy(self, keep):
        draft = real(self, keep)
        if not _DRAFTS:  # (the checks read the first step's)
            drawn = sum(nd.q is not None for nd in self.kept)
            lookup = sum(nd.conf is None for nd in self.kept)
            _DRAFTS.append((drawn, lookup, draft.parents is not None))
        return draft

    spy.is_spy = True  # (lookup guesses have conf None and q None: counted as lookup, not drawn)
    monkeypatch.setattr(TreeDrafter, "_draft", spy)


def _generate(engine, kwargs, seeds) -> dict:
    """Run the generations with these seeds; counts of the emitted triples and what speculation did."""
    counts = np.zeros((V,) * NEW)
    s = dict(
        n=0,
        first_drafted=0,
        first_nodes=0,
        accepted=0,
        rejected=0,
        bonus=0,
        passes=0,
        drafted=0,
        first_lookup=0,
        first_drawn=0,
        first_siblings=0,
        strategies={},
    )
    for seed in seeds:
        del _DRAFTS[:]
        stream = engine.stream(PROMPT, max_new_tokens=NEW, seed=seed, **kwargs)
        first = None
        for _ in stream:  # one text delta per target pass (one character per token, no stop strings)
            if first is None:
                first = stream.stats.drafted  # what the first target pass verified
        ids = stream.result.token_ids
        assert len(ids) == NEW, ids
        counts[tuple(ids)] += 1
        st = stream.result.stats
        s["n"] += 1
        s["first_drafted"] += first > 0
        s["first_nodes"] += first
        s["accepted"] += st.accepted > 0
        s["rejected"] += st.rejections > 0
        # passes that drafted and accepted every drafted token: they emit a bonus token drawn from p
        s["bonus"] += st.target_forwards - st.rejections - st.strategies.get("plain", 0) > 0
        s["passes"] += st.target_forwards
        s["drafted"] += st.drafted
        for k, v in st.strategies.items():
            s["strategies"][k] = s["strategies"].get(k, 0) + v
        if _DRAFTS:
            drawn, lookup, branching = _DRAFTS[0]
            s["first_drawn"] += drawn > 0
            s["first_lookup"] += lookup > 0
            s["first_siblings"] += branching
    return {"counts": counts, "summary": s}


def _merge(parts: list[dict]) -> tuple[np.ndarray, SimpleNamespace]:
    counts = sum(p["counts"] for p in parts)
    total: dict = {}
    for p in parts:
        for k, v in p["summary"].items():
            if isinstance(v, dict):
                d = total.setdefault(k, {})
                for kk, vv in v.items():
                    d[kk] = d.get(kk, 0) + vv
            else:
                total[k] = total.get(k, 0) + v
    return counts, SimpleNamespace(**total)


def _workers() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8)) if hasattr(os, "fork") else 1


def _in_parallel(fn, chunks: list) -> list:
    """fn(chunk) for every chunk: the first in this process, the others in forked children (which
    inherit the models, their replay tables and any monkeypatch) that send back their pickled result."""
    kids = []
    for chunk in chunks[1:]:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 0
            try:
                os.close(r)
                try:
                    data = pickle.dumps((True, fn(chunk)))
                except BaseException:
                    data = pickle.dumps((False, traceback.format_exc()))
                with os.fdopen(w, "wb") as f:
                    f.write(data)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        kids.append((pid, r))
    results, errors = [], []
    try:
        results.append(fn(chunks[0]))
    finally:
        for pid, r in kids:
            with os.fdopen(r, "rb") as f:
                data = f.read()
            os.waitpid(pid, 0)
            ok, value = pickle.loads(data) if data else (False, "a worker died without a result")
            (results if ok else errors).append(value)
    if errors:
        raise AssertionError("a worker failed:\n" + errors[0])
    return results


def sample_engine(engine, monkeypatch, method: str, setting: str, n: int, seed0: int = 0):
    """n generations through Engine.stream (seeds seed0 .. seed0+n-1), split across the cores."""
    kwargs, costs = METHODS[method]
    kwargs = {**kwargs, **SETTINGS[setting]}
    monkeypatch.setattr(engine, "costs", costs)
    if method == "lookup":
        import tempfile
        from pathlib import Path

        monkeypatch.setattr(engine, "datastore", None)
        _lookup_sources(engine, monkeypatch, Path(tempfile.mkdtemp()))
    # auto runs its first AUTO_PROBE_STEPS steps of each generation without the draft model (a measured
    # baseline); with 3 tokens per generation it would never draft: the draft model drafts from step 1
    monkeypatch.setattr(builders_mod, "AUTO_PROBE_STEPS", 0)
    _spy_on_tree_drafts(monkeypatch)
    k = _workers()
    seeds = range(seed0, seed0 + n)
    chunks = [seeds[i::k] for i in range(k)]
    t = time.perf_counter()
    counts, s = _merge(_in_parallel(lambda c: _generate(engine, kwargs, c), chunks))
    s.wall_s = time.perf_counter() - t
    s.workers = k
    assert s.n == n and counts.sum() == n
    return counts, s


def _report(name, s, p):
    print(
        f"\n{name}: n={s.n} workers={s.workers} {s.wall_s:.1f}s; p-values "
        + " ".join(f"{k}={v:.3g}" for k, v in p.items())
        + f"; first pass drafted {s.first_drafted / s.n:.3f} ({s.first_nodes / s.n:.2f} nodes), "
        f"accepted {s.accepted / s.n:.2f} rejected {s.rejected / s.n:.2f} bonus {s.bonus / s.n:.2f} of samples, "
        f"passes {s.passes / s.n:.2f}/sample, strategies {s.strategies}, first pass: drawn "
        f"{s.first_drawn / s.n:.2f} lookup {s.first_lookup / s.n:.2f} branching {s.first_siblings / s.n:.2f}"
    )


# ============================================================= negative controls (WRONG on purpose)


_FULL_DRAFT = {}


def with_full_q(p, q, draft_tokens, generator=None):
    """The q rows renormalised over all V tokens as if the output layer were whole: each row mixed
    with the uniform law (what a forgotten truncation would make of q). Wrong: tokens are drawn from
    the truncated q, so the acceptance ratio p/q is off."""
    if q is not None:  # (a plain step drafts nothing)
        q = 0.5 * q + 0.5 / q.shape[-1]
    return real_verify(p, q, draft_tokens, generator)


def prune_drawn_nodes(self, params):
    """A sampled tree that drops the drawn nodes the draft found unlikely (q < 0.2), with their
    subtrees, after drawing them: the survivors are no longer draws from the q rows they carry."""
    keep = []
    for i, nd in enumerate(self.nodes):  # parents come before children
        if (nd.parent < 0 or nd.parent in keep) and (nd.conf is None or nd.conf >= 0.2):
            keep.append(i)
    return keep


def _wrong(monkeypatch, control: str):
    if control == "accept_everything":
        monkeypatch.setattr(verify_mod, "verify", accept_everything)
    elif control == "residual_is_p":
        monkeypatch.setattr(verify_mod, "verify", residual_is_p)
    elif control == "no_residual_update":  # siblings tried against p itself (test_verify_tree's control)
        monkeypatch.setattr(verify_mod, "verify_tree", no_residual_update("p"))
        monkeypatch.setattr(verify_mod, "verify", residual_is_p)  # (chains in a tree method)
    elif control == "full_q":  # drafts from the truncated q but verifies with the whole draft's softmax
        monkeypatch.setattr(verify_mod, "verify", with_full_q)
    elif control == "prune_drawn_nodes":
        monkeypatch.setattr(TreeDrafter, "_select", prune_drawn_nodes)
    else:
        raise ValueError(control)


def controls(method: str, setting: str) -> list[str]:
    """The wrong engines each case must reject. (The first pass of a tree method is nearly always a
    tree, so a wrong chain verifier hardly shows there; pruning by q < 0.2 hardly ever prunes a top-3
    q, nor the narrow trees of the auto case.)"""
    return {
        "draft": ["residual_is_p"],
        "pld": ["residual_is_p"],
        "auto": ["no_residual_update"],
        "draft-frspec": ["residual_is_p", "full_q"],
        "lookup": ["no_residual_update"],
        "auto-lookup": ["accept_everything"],
        "auto-prediction": ["accept_everything", "residual_is_p"],
        "tree": ["no_residual_update"] + (["prune_drawn_nodes"] if setting != "topk3" else []),
    }[method]


# ============================================================= the tests

# pld (a one-hot q through the chain rule) at T=1 only: under truncation the same rule with a one-hot q is the
# auto-lookup case at top-k 3 (one lookup guess, a chain) and the lookup case at top-p 0.7 (chains and trees of
# guesses); two cases of ~3 minutes each on 2 cores that tested nothing the others do not
CASES = (
    [(m, s) for m in ("draft", "tree", "auto") for s in SETTINGS]
    + [("pld", "T1"), ("auto-lookup", "topk3")]
    + [("lookup", "T1"), ("lookup", "topp0.7"), ("draft-frspec", "T1"), ("auto-prediction", "T1")]
)


def test_cost_tables_choose_what_the_cases_are_about():
    assert draft_model_can_pay(WIDE) and draft_model_can_pay(NARROW) and not draft_model_can_pay(NO_DRAFT)


@pytest.mark.stat
@pytest.mark.parametrize("method, setting", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_engine_keeps_the_target_law(request, monkeypatch, method, setting):
    engine = request.getfixturevalue("frspec_engine" if method == "draft-frspec" else "engine")
    law = law_of(setting)
    counts, s = sample_engine(engine, monkeypatch, method, setting, N)
    p = pvalues(counts, law)
    _report(f"{method}/{setting}", s, p)

    # speculation really happened, in the way the case is about
    assert s.first_drafted >= 0.95 * N  # the first target pass verified drafted tokens
    assert s.accepted >= 0.2 * N and s.rejected >= 0.2 * N  # both halves of the rule ran, often
    assert s.bonus >= 0.05 * N  # and whole drafts were accepted, with their bonus token
    if method in ("pld", "auto-lookup", "lookup"):
        assert s.strategies.get("lookup", 0) >= 0.5 * N
    if method == "lookup":  # deterministic trees with siblings, and no draft model
        assert s.first_drawn == 0 and s.first_lookup >= 0.95 * N and s.first_siblings >= 0.3 * N
    if method == "auto-lookup":
        assert s.first_lookup >= 0.95 * N and s.first_drawn == 0  # the draft model never ran
    if method == "auto-prediction":  # the first pass rides the prediction; later ones draw from the draft model
        assert s.first_lookup >= 0.95 * N and s.first_drawn == 0 and s.strategies.get("copy", 0) >= 0.95 * N
        assert s.strategies.get("tree", 0) + s.strategies.get("draft", 0) >= 0.1 * N
    if method in ("draft", "draft-frspec"):
        assert s.first_nodes == 2 * N  # gamma = 2: a two-token chain
    if method == "draft-frspec":  # the target emits tokens the draft can no longer propose
        assert counts[5:].sum() + counts[:, 5:].sum() + counts[:, :, 5:].sum() >= 0.05 * N
    if method in ("tree", "auto"):
        assert s.first_drawn >= 0.95 * N  # the draft model drafts
    if method == "tree":
        assert s.first_siblings >= 0.9 * N and s.first_nodes >= 3.5 * N  # wide trees
    if method == "auto":
        assert s.first_lookup >= 0.5 * N  # prompt-lookup branches next to the drawn ones
        assert s.strategies.get("draft", 0) >= 0.05 * N and s.strategies.get("tree", 0) >= 0.3 * N  # chains and trees

    for name, value in p.items():
        assert value > ALPHA, (name, value)

    # negative controls: the same harness with a wrong engine must be rejected
    for control in controls(method, setting):
        with monkeypatch.context() as m:
            _wrong(m, control)
            bad, sb = sample_engine(engine, m, method, setting, N_CONTROL, seed0=10**7)
        pb = pvalues(bad, law)
        _report(f"{method}/{setting} control {control}", sb, pb)
        assert sb.first_drafted >= 0.5 * N_CONTROL
        assert min(pb.values()) < ALPHA, (control, pb)
