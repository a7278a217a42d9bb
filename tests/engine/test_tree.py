"""Token trees end to end (tree.py through the speculative_decode loop and the Engine).

Greedy trees of every shape emit exactly the autoregressive output; the chain method (the one-child
tree) is unchanged; both KV caches stay compact through the loop; stats count the tree; the cost
model and calibration behave; the adaptive planner backs off or grows as its costs say; sampled
trees keep the target's distribution (chi-square, with a wrong verifier as negative control).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import specdecode.planning.costs as costs_mod
import specdecode.verify as verify_mod  # noqa: E402  (verify.verdict calls verify, verify_tree from here)
from helpers import CHEAP, EXPENSIVE, no_residual_update, run  # run: the loop driven on token ids
from specdecode import SamplingParams, SpecDecodeError, Stats, speculative_decode
from specdecode.backends import CachedLM
from specdecode.drafters import DraftModel
from specdecode.planning.costs import Calibration, CostModel, load_or_measure, measure
from specdecode.planning.tree import MAX_DEPTH, MAX_NODES, MAX_WIDTH, TreeDrafter
from specdecode.sampling import probs_from_logits
from tiny import tiny_model

GREEDY = SamplingParams()
V = 257

PROMPTS = [
    [5, 17, 42, 99, 3],
    list(range(30, 60)),
    [104, 101, 108, 108, 111, 32] * 6 + [104, 101],  # repetitive: prompt lookup hits
]


def run_tree(target_model, drafter, prompt, n, **kw):
    """The tree method as the Engine runs it: gamma = the drafter's depth cap."""
    return run(CachedLM(target_model), drafter, prompt, drafter.max_depth, n, **kw)


@pytest.fixture(scope="module")
def models():
    return tiny_model(0), tiny_model(1)


@pytest.fixture(scope="module")
def plain(models):
    """Greedy autoregressive output of the target: 250 tokens computed once per prompt, cut to n."""
    memo = {}

    def get(prompt, n):
        assert n <= 250
        if tuple(prompt) not in memo:
            memo[tuple(prompt)] = run(CachedLM(models[0]), None, prompt, 0, 250)[0]
        return memo[tuple(prompt)][:n]

    return get


def check_stats(stats, out, n):
    assert stats.new_tokens == len(out) == n
    assert stats.accepted <= stats.drafted
    assert sum(stats.accepted_per_position) == stats.accepted
    assert len(stats.accepted_per_position) == len(stats.drafted_per_position)
    assert all(a <= d for a, d in zip(stats.accepted_per_position, stats.drafted_per_position))
    assert stats.new_tokens == stats.accepted + stats.target_forwards  # one residual/bonus per pass, no EOS cut
    assert stats.tree_depth <= stats.drafted


def passes_without_draft(stats):
    return stats.target_forwards - (stats.drafted_per_position[0] if stats.drafted_per_position else 0)


# ============================================================= 1. greedy trees == autoregressive

# (width, depth, nodes); None = the default cap (nodes: unbounded when width and depth are given)
FIXED_SHAPES = [
    (1, 5, None),  # a chain (more chains: the draft = target and the chain-method tests)
    (4, 1, None),
    (4, 2, None),  # wide and shallow
    (2, 6, None),
    (1, 8, 3),  # narrow and deep; a deep chain cut to 3 nodes
    (3, 4, 5),
    (4, 3, 2),  # node budgets far below width * depth
]


@pytest.mark.parametrize("shape", FIXED_SHAPES, ids=lambda s: "w%s-d%s-n%s" % s)
def test_greedy_fixed_shape_equals_plain(models, plain, shape):
    target_model, draft_model = models
    width, depth, nodes = shape
    prompt = PROMPTS[FIXED_SHAPES.index(shape) % 3]
    drafter = TreeDrafter(DraftModel(draft_model, V), width=width, depth=depth, nodes=nodes)
    out, stats = run_tree(target_model, drafter, prompt, 200)
    assert out == plain(prompt, 200)
    check_stats(stats, out, 200)
    cap = nodes if nodes is not None else width + width * width * (depth - 1) + depth  # + a lookup branch
    assert stats.drafted <= cap * stats.target_forwards
    assert len(stats.drafted_per_position) <= depth
    # a fixed shape drafts on every pass but the prompt's (greedy: its last row gives the first token) and a
    # last one with room for one token only
    assert stats.drafted_per_position[0] >= stats.target_forwards - 2


@pytest.mark.parametrize("costs", [CHEAP, EXPENSIVE], ids=["cheap", "expensive"])
@pytest.mark.parametrize("fixed", [{}, {"depth": 3}, {"width": 2, "nodes": 6}], ids=lambda d: str(d or "adaptive"))
def test_greedy_adaptive_shape_equals_plain(models, plain, costs, fixed):
    target_model, draft_model = models
    prompt = PROMPTS[(len(fixed) + (costs is CHEAP)) % 3]  # spread over the prompts
    drafter = TreeDrafter(DraftModel(draft_model, V), costs=costs, **fixed)
    out, stats = run_tree(target_model, drafter, prompt, 200)
    assert out == plain(prompt, 200)
    check_stats(stats, out, 200)
    assert len(stats.drafted_per_position) <= fixed.get("depth", MAX_DEPTH)
    assert stats.drafted <= fixed.get("nodes", MAX_NODES) * stats.target_forwards


def test_greedy_draft_equals_target_accepts_the_top1_chain(models, plain):
    target_model, _ = models
    for prompt in (PROMPTS[0], PROMPTS[2]):
        # a chain of the target itself: everything is accepted, 7 tokens per pass until the end
        drafter = TreeDrafter(DraftModel(target_model, V), pld=False, width=1, depth=6)
        out, stats = run_tree(target_model, drafter, prompt, 250)
        assert out == plain(prompt, 250)
        check_stats(stats, out, 250)
        assert stats.accepted == stats.drafted and stats.rejections == 0
        assert stats.mean_accepted_tokens > 6.5
    # a wider tree of the target (top-1 child first at every node), with prompt-lookup branches
    drafter = TreeDrafter(DraftModel(target_model, V), width=2, depth=4, nodes=8)
    out, stats = run_tree(target_model, drafter, PROMPTS[1], 250)
    assert out == plain(PROMPTS[1], 250)
    check_stats(stats, out, 250)
    assert stats.mean_accepted_tokens > 2.5


@pytest.mark.parametrize(
    "kw",
    [dict(width=1, depth=5), dict(width=1, depth=8, nodes=4), dict(costs=CHEAP)],
    ids=["chain5", "chain8-n4", "cheap"],
)
def test_greedy_pld_only_tree_equals_plain(models, plain, kw):
    target_model, _ = models
    for prompt in PROMPTS[1:]:
        drafter = TreeDrafter(None, pld=True, **kw)
        out, stats = run_tree(target_model, drafter, prompt, 250)
        assert out == plain(prompt, 250)
        check_stats(stats, out, 250)
        if prompt is PROMPTS[2] and "width" in kw:
            assert stats.accepted > 0  # the repetitive prompt: lookup hits


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_max_new_tokens_inside_a_tree(models, plain, n):
    target_model, _ = models
    for kw in (dict(width=2, depth=8), dict(costs=CHEAP)):
        drafter = TreeDrafter(DraftModel(target_model, V), **kw)
        out, stats = run_tree(target_model, drafter, PROMPTS[0], n)
        assert out == plain(PROMPTS[0], n) and stats.finish_reason == "length"
        assert len(stats.drafted_per_position) <= n - 1  # never drafts what it cannot emit


def test_tree_stops_at_the_context_limit():
    small = tiny_model(0, max_pos=40)
    want, _ = run(CachedLM(small), None, PROMPTS[1], 0, 100)
    for drafter in (
        TreeDrafter(DraftModel(small, V), width=3, depth=8),
        TreeDrafter(DraftModel(tiny_model(1), V), costs=CHEAP),
    ):
        out, stats = run_tree(small, drafter, PROMPTS[1], 100)
        assert out == want and len(out) == 10 and stats.finish_reason == "length"


# ============================================================= 2. the chain method is unchanged


@pytest.mark.parametrize("gamma", [1, 2, 3, 4, 5, 6])
def test_chain_draft_method_equals_plain(models, plain, gamma):
    target_model, draft_model = models
    prompt = PROMPTS[gamma % 3]
    drafter = DraftModel(draft_model, V)
    out, stats = run(CachedLM(target_model), drafter, prompt, gamma, 80)
    assert out == plain(prompt, 80)
    check_stats(stats, out, 80)
    assert stats.tree_depth == stats.drafted  # a chain's depth is its length
    assert len(stats.drafted_per_position) <= gamma


def test_chain_draft_method_sampled_is_reproducible(models):
    target_model, draft_model = models
    params = SamplingParams(temperature=0.9, top_k=40)
    a, sa = run(CachedLM(target_model), DraftModel(draft_model, V), PROMPTS[0], 4, 30, params, seed=11)
    b, sb = run(CachedLM(target_model), DraftModel(draft_model, V), PROMPTS[0], 4, 30, params, seed=11)
    c, _ = run(CachedLM(target_model), DraftModel(draft_model, V), PROMPTS[0], 4, 30, params, seed=12)
    assert a == b and a != c and len(a) == 30
    assert (sa.accepted, sa.drafted, sa.target_forwards) == (sb.accepted, sb.drafted, sb.target_forwards)


def test_sampled_tree_is_reproducible(models):
    target_model, draft_model = models
    params = SamplingParams(temperature=1.0)
    outs = []
    for seed in (5, 5, 6):
        drafter = TreeDrafter(DraftModel(draft_model, V), width=3, depth=3)
        outs.append(run_tree(target_model, drafter, PROMPTS[2], 40, params=params, seed=seed)[0])
    assert outs[0] == outs[1] and outs[0] != outs[2]


# ============================================================= 3. KV compaction through the loop


@pytest.mark.parametrize("kw", [dict(costs=CHEAP), dict(width=3, depth=4, nodes=7)], ids=["adaptive", "fixed"])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0)], ids=["greedy", "sampled"])
def test_caches_hold_exactly_the_committed_text(models, plain, kw, params):
    target_model, draft_model = models
    target = CachedLM(target_model)
    drafter = TreeDrafter(DraftModel(draft_model, V), **kw)
    dlm = drafter.model.lm
    committed = list(PROMPTS[2])
    stats = Stats()
    for step, new in enumerate(
        speculative_decode(
            target,
            drafter,
            committed[:],
            gamma=drafter.max_depth,
            params=params,
            max_new_tokens=90,
            eos_ids=set(),
            generator=torch.Generator().manual_seed(1),
            stats=stats,
        )
    ):
        committed += new
        # target: every committed token but the last, as a plain trunk (no stale tree entries)
        assert target.ids == committed[:-1]
        assert target.trunk == len(target.ids) and target.parent == [] and target.pos == []
        # draft: a prefix of the committed text, also a plain trunk
        assert dlm.ids == committed[: len(dlm.ids)]
        assert dlm.trunk == len(dlm.ids) and dlm.parent == [] and dlm.pos == []
        if step % 4 == 0:  # the caches behave like fresh prefills of the committed text
            got = target.forward([committed[-1]])[-1]
            target.rollback(len(committed) - 1)
            torch.testing.assert_close(
                got, CachedLM(target_model).forward(committed, last_only=True)[-1], rtol=1e-4, atol=1e-4
            )
            assert target.ids == committed[:-1] and target.trunk == len(target.ids)
            n = len(dlm)
            got = dlm.forward(committed[n:])[-1]
            dlm.rollback(n)
            torch.testing.assert_close(
                got, CachedLM(draft_model).forward(committed, last_only=True)[-1], rtol=1e-4, atol=1e-4
            )
            assert dlm.ids == committed[:n] and dlm.trunk == n
    assert len(committed) == len(PROMPTS[2]) + 90 and stats.drafted > 0 and stats.accepted > 0
    if params.greedy:
        assert committed[len(PROMPTS[2]) :] == plain(PROMPTS[2], 90)


# ============================================================= 4. stats


def test_stats_of_a_fixed_shape(models, plain):
    target_model, draft_model = models
    for prompt in PROMPTS[1:]:
        drafter = TreeDrafter(DraftModel(draft_model, V), width=2, depth=3, nodes=5, costs=CHEAP)
        out, s = run_tree(target_model, drafter, prompt, 120)
        assert out == plain(prompt, 120)
        assert s.drafted <= 5 * s.target_forwards
        assert s.tree_depth <= 3 * s.target_forwards
        assert len(s.drafted_per_position) <= 3
        assert s.accepted <= s.drafted
        assert s.new_tokens == s.accepted + s.target_forwards == 120
        assert sum(s.accepted_per_position) == s.accepted
        assert s.accepted_per_position[0] <= s.drafted_per_position[0] <= s.target_forwards
        assert s.rejections <= s.target_forwards
        assert s.finish_reason == "length"
        e = s.expected_tokens_per_pass
        assert isinstance(e, float) and e >= 1.0
        assert s.planned_passes <= s.target_forwards
        d = s.as_dict()
        assert d["mean_tree_nodes"] == s.drafted / s.target_forwards <= 5
        assert d["expected_tokens_per_pass"] == e


def test_eos_inside_an_accepted_branch_stops_there(models, plain):
    target_model, draft_model = models
    full = plain(PROMPTS[0], 100)
    eos = full[37]
    cut = full[: full.index(eos) + 1]
    cases = [
        (TreeDrafter(DraftModel(target_model, V), width=2, depth=6, pld=False), True),
        (TreeDrafter(DraftModel(target_model, V), costs=CHEAP), False),
        (TreeDrafter(DraftModel(draft_model, V), width=3, depth=4, nodes=8), False),
        (TreeDrafter(None, width=1, depth=6), False),
    ]
    for drafter, all_accepted in cases:
        out, stats = run_tree(target_model, drafter, PROMPTS[0], 100, eos={eos})
        assert out == cut
        assert stats.finish_reason == "eos" and stats.new_tokens == len(cut)
        if all_accepted:  # the draft is the target: EOS came inside an accepted branch, the rest was cut
            assert stats.accepted + stats.target_forwards > stats.new_tokens


def test_sampled_tree_respects_the_node_budget(models):
    target_model, draft_model = models
    for kw in (dict(width=2, depth=3, nodes=5), dict(nodes=5, costs=CHEAP)):
        drafter = TreeDrafter(DraftModel(draft_model, V), **kw)
        stats, before, most = Stats(), 0, 0
        for _ in speculative_decode(
            CachedLM(target_model),
            drafter,
            PROMPTS[0],
            gamma=drafter.max_depth,
            params=SamplingParams(temperature=1.0),
            max_new_tokens=40,
            eos_ids=set(),
            generator=torch.Generator().manual_seed(0),
            stats=stats,
        ):
            most, before = max(most, stats.drafted - before), stats.drafted
        assert most <= 5, f"{most} nodes in one pass with tree_nodes=5 ({kw})"


# ============================================================= 5. cost model and calibration


def test_cost_model_interpolates_and_extrapolates():
    c = CostModel({1: 1.0, 2: 1.5, 4: 2.0, 8: 4.0}, {1: 0.1, 4: 0.4})
    assert c.t(1) == 1.0 and c.t(2) == 1.5 and c.t(8) == 4.0
    assert c.t(3) == pytest.approx(1.75)
    assert c.t(6) == pytest.approx(3.0)
    assert c.t(12) == pytest.approx(6.0)  # the last segment's slope, continued
    assert c.t(16) == pytest.approx(8.0)
    assert c.d(2) == pytest.approx(0.2) and c.d(3) == pytest.approx(0.3) and c.d(8) == pytest.approx(0.8)
    ts = [c.t(n) for n in range(1, 40)]
    assert ts == sorted(ts)
    assert CostModel({1: 1.0, 2: 2.0}).d(5) == 0.0  # no draft model: drafting is free
    below = CostModel({2: 2.0, 4: 3.0})
    assert below.t(1) == pytest.approx(1.0)  # below the first point: proportional
    assert below.t(2) == 2.0 and below.t(3) == pytest.approx(2.5) and below.t(6) == pytest.approx(4.0)
    rel = c.as_dict()
    assert rel["target_s_1"] == 1.0 and rel["target"][8] == 4.0 and rel["draft"][4] == pytest.approx(0.4)
    # a last segment that falls (a faster kernel from 16 tokens: whole calls over 4 slots on a Zen 4, ms) is not
    # continued downwards: past the table, the whole table's slope (34 -> 274 over 1 -> 16 tokens)
    calls = CostModel({1: 34, 4: 96, 8: 240, 12: 328, 16: 274})
    assert calls.t(16) == 274 and calls.t(14) == pytest.approx(301)  # inside the table: as measured
    assert calls.t(24) == pytest.approx(274 + 8 * 240 / 15)
    past = [calls.t(n) for n in range(16, 64)]
    assert past == sorted(past) and calls.t(20) > calls.t(16)
    assert CostModel({4: 2.0}).t(8) == pytest.approx(4.0)  # one point: proportional on both sides


# measure() feeds context ids up to 999: these tests use a tiny model with a 1024-token vocabulary
# (see test_measure_works_for_a_small_vocabulary for the 257-token one)
@pytest.fixture(scope="module")
def wide_models():
    return tiny_model(0, vocab_size=1024), tiny_model(1, vocab_size=1024)


def test_measure_returns_positive_times_by_size(wide_models):
    """Kept as measured, not made monotone (a bigger pass may be cheaper: test_context_costs)."""
    lm = CachedLM(wide_models[0])
    sizes = [1, 2, 4, 8, 16]
    times = measure(lm, sizes, repeats=2)
    assert list(times) == sorted(times) and set(times) <= set(sizes) and 1 in times
    assert all(v > 0 for v in times.values())
    assert len(lm) == 0  # left reset


def test_measure_works_for_a_small_vocabulary(models):
    times = measure(CachedLM(models[0]), [1, 2], repeats=1)
    assert set(times) == {1, 2}


def test_load_or_measure_caches_as_json(wide_models, monkeypatch):
    from specdecode.backends import cache_dir

    target, draft = CachedLM(wide_models[0]), CachedLM(wide_models[1])
    calls = []
    real = costs_mod.measure

    def counting(lm, sizes, **kw):
        calls.append(list(sizes))
        return real(lm, sizes, repeats=1, **{k: v for k, v in kw.items() if k != "repeats"})

    monkeypatch.setattr(costs_mod, "measure", counting)
    first = load_or_measure(target, draft, progress=False)
    assert len(calls) == 2  # target and draft
    files = list((cache_dir() / "costs").glob("*.json"))
    assert len(files) == 1 and str(files[0]).startswith(str(cache_dir()))
    raw = json.loads(files[0].read_text())
    assert set(raw) >= {"target", "draft"} and raw["target"] and raw["draft"]
    assert first.target and first.draft and first.t(1) > 0 and first.d(1) > 0

    def boom(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(costs_mod, "measure", boom)
    second = load_or_measure(target, draft, progress=False)
    assert second.target == first.target and second.draft == first.draft
    assert all(isinstance(k, int) for k in second.target)

    # a damaged file is measured again and rewritten
    monkeypatch.setattr(costs_mod, "measure", counting)
    for damage in (
        "{not json",
        files[0].read_text()[:20],
        "",
        json.dumps({"draft": {}}),
        "[1, 2]",
        json.dumps({"target": {"one": 1.0}}),
    ):
        files[0].write_text(damage)
        calls.clear()
        again = load_or_measure(target, draft, progress=False)
        assert len(calls) == 2 and again.target
        json.loads(files[0].read_text())  # valid again
    assert not list((cache_dir() / "costs").glob("*.tmp*"))


def test_load_or_measure_keys_the_file_by_models(wide_models, monkeypatch):
    from specdecode.backends import cache_dir

    calls = []
    monkeypatch.setattr(costs_mod, "measure", lambda lm, sizes, **kw: calls.append(lm) or {n: 0.01 * n for n in sizes})
    target, draft = CachedLM(wide_models[0]), CachedLM(wide_models[1])
    with_draft = load_or_measure(target, draft, progress=False)
    assert with_draft.draft and len(calls) == 2
    alone = load_or_measure(target, None, progress=False)  # another model set: measured, another file
    assert len(calls) == 3 and alone.draft == {} and alone.d(4) == 0.0
    other = CachedLM(tiny_model(2, vocab_size=1024, hidden=32))
    load_or_measure(other, None, progress=False)
    assert len(calls) == 4
    assert len(list((cache_dir() / "costs").glob("*.json"))) == 3


@pytest.mark.parametrize("damage", [{"target": [1, 2]}, {"target": {}}, {"target": {"1": "fast"}}], ids=repr)
def test_load_or_measure_remeasures_a_malformed_table(wide_models, monkeypatch, damage):
    from specdecode.backends import cache_dir

    target = CachedLM(wide_models[0])
    monkeypatch.setattr(costs_mod, "measure", lambda lm, sizes, **kw: {n: 0.01 * n for n in sizes})
    load_or_measure(target, None, progress=False)
    (path,) = (cache_dir() / "costs").glob("*.json")
    path.write_text(json.dumps(damage))
    costs = load_or_measure(target, None, progress=False)
    assert costs.t(2) == pytest.approx(0.02)


def test_engine_measures_costs_once(monkeypatch, make_engine):
    engine = make_engine(progress=False)
    calls = []

    def fake(lm, sizes, **kw):  # no timing: a fixed table (and no dependence on the machine's speed)
        calls.append(list(sizes))
        return {n: 0.01 + 0.001 * n for n in sizes}

    monkeypatch.setattr(costs_mod, "measure", fake)
    engine.generate("ab", method="tree", max_new_tokens=5)
    engine.generate("ab", method="tree", max_new_tokens=5, tree_width=1)
    assert len(calls) == 2 and engine.costs is not None  # target and draft, once
    assert engine.costs.t(4) == pytest.approx(0.014) and engine.costs.d(2) == pytest.approx(0.012)
    # a new engine for the same models reads the cached file
    other = make_engine(progress=False)
    assert other.tree_costs().target == engine.costs.target
    assert len(calls) == 2


def test_calibration_starts_at_prior_and_learns():
    cal = Calibration()
    for x, centre in ((0.0, 0.05), (0.31, 0.35), (0.35, 0.35), (0.99, 0.95), (1.0, 0.95)):
        assert cal(x) == pytest.approx(centre)
    look = Calibration(bins=8, prior=lambda x: 0.5)
    assert all(look(d / 8) == pytest.approx(0.5) for d in range(8))
    rng = np.random.default_rng(0)
    track = [cal(0.35)]
    for i in range(2000):
        cal.update(0.35, bool(rng.random() < 0.8))
        if i in (3, 30, 300):
            track.append(cal(0.35))
    track.append(cal(0.35))
    assert track == sorted(track) and track[0] < track[1]  # moves towards the observed 0.8
    assert cal(0.35) == pytest.approx(0.8, abs=0.03)
    assert cal(0.32) == cal(0.35)  # same bin
    assert cal(0.75) == pytest.approx(0.75) and cal(0.05) == pytest.approx(0.05)  # other bins untouched
    for _ in range(50):
        cal.update(0.95, False)
    assert cal(0.95) < 0.1
    # exactly a Beta prior: (hits + w * centre) / (tries + w)
    c = Calibration(weight=4.0)
    c.update(0.5, True)
    c.update(0.5, False)
    c.update(0.5, True)
    assert c(0.5) == pytest.approx((2 + 4 * 0.55) / (3 + 4))


# ============================================================= 6. the planner


def test_expensive_costs_back_off_to_plain_decoding(models, plain):
    target_model, draft_model = models
    for prompt in PROMPTS[:2]:
        drafter = TreeDrafter(DraftModel(draft_model, V), costs=EXPENSIVE)
        out, stats = run_tree(target_model, drafter, prompt, 250)
        assert out == plain(prompt, 250)
        check_stats(stats, out, 250)
        assert stats.mean_tree_nodes < 1.0
        assert passes_without_draft(stats) > stats.target_forwards / 2
        assert stats.target_forwards > 150


def test_cheap_costs_grow_deep_trees_for_a_good_draft(models, plain):
    target_model, _ = models
    depths = []
    for prompt in PROMPTS[:2]:
        drafter = TreeDrafter(DraftModel(target_model, V), costs=CHEAP)
        out, stats = run_tree(target_model, drafter, prompt, 250)
        assert out == plain(prompt, 250)
        check_stats(stats, out, 250)
        depths.append(stats.tree_depth / stats.target_forwards)
        # the tiny model's top-1 confidence is often under 0.1, the calibration bin of the rejected
        # siblings too, which keeps the planner near depth 2 on some prompts (2.4 and 1.95 here)
        assert depths[-1] > 1.8 and len(stats.drafted_per_position) >= 3
        assert stats.mean_accepted_tokens > 2.5
        assert stats.mean_tree_nodes > 4  # cheap width: wide trees
        assert passes_without_draft(stats) <= 1  # (the last pass, with room for one token, drafts nothing)
    assert sum(depths) / len(depths) > 2.0


# ============================================================= 7. sampled trees are lossless

SV = 6  # a small vocabulary: the joint law of two tokens has 36 cells
SAMPLED = SamplingParams(temperature=1.0)
ALPHA = 1e-6


@pytest.fixture(scope="module")
def small_models():
    return (
        tiny_model(0, vocab_size=SV, layers=1, eos_token_id=None),
        tiny_model(1, vocab_size=SV, layers=1, eos_token_id=None),
    )


def exact_pair_law(model, prompt):
    """P(x1, x2 | prompt) = p(x1 | prompt) p(x2 | prompt, x1), with the engine's own transform."""
    p1 = probs_from_logits(CachedLM(model).forward(prompt, last_only=True)[-1], SAMPLED)
    rows = [probs_from_logits(CachedLM(model).forward(prompt + [x], last_only=True)[-1], SAMPLED) for x in range(SV)]
    law = (p1[:, None] * torch.stack(rows)).double().numpy()
    return law / law.sum()


def sampled_pairs(models, prompt, n_runs, pld, seed0=0):
    """Counts [SV, SV] of the first two tokens over n_runs runs with a sampled width-3 depth-2 tree.
    max_new_tokens=3 lets the first pass draft two deep; a run stops as soon as it has two tokens.
    Also returns how many first passes verified a tree with prompt-lookup nodes (over 12 nodes)."""
    target_model, draft_model = models
    target = CachedLM(target_model)
    drafter = TreeDrafter(DraftModel(draft_model, SV), pld=pld, width=3, depth=2, adaptive=False)
    counts = np.zeros((SV, SV))
    total, with_lookup = Stats(), 0
    for s in range(n_runs):
        out, stats = [], Stats()
        steps = speculative_decode(
            target,
            drafter,
            prompt,
            gamma=2,
            params=SAMPLED,
            max_new_tokens=3,
            eos_ids=set(),
            generator=torch.Generator().manual_seed(seed0 + s),
            stats=stats,
        )
        for new in steps:
            with_lookup += not out and stats.drafted > 12
            out += new
            if len(out) >= 2:
                break
        steps.close()
        counts[out[0], out[1]] += 1
        for key in ("drafted", "accepted", "target_forwards", "tree_depth"):
            setattr(total, key, getattr(total, key) + getattr(stats, key))
        total.accepted_per_position += [0] * (len(stats.accepted_per_position) - len(total.accepted_per_position))
        for i, a in enumerate(stats.accepted_per_position):
            total.accepted_per_position[i] += a
    return counts, total, with_lookup


def pair_pvalue(counts, law, min_expected=5.0):
    """Chi-square p-value of the counts against the law; cells expecting < min_expected are pooled."""
    n = counts.sum()
    expected, observed = (law * n).ravel(), counts.ravel()
    assert observed[expected == 0].sum() == 0
    small = expected < min_expected
    obs, exp = observed[~small], expected[~small]
    if small.any():
        obs, exp = np.append(obs, observed[small].sum()), np.append(exp, expected[small].sum())
    return chisquare(obs, exp / exp.sum() * obs.sum()).pvalue


# target p(.|prompt) ~ [.31 .29 .01 .14 .25 .01], draft q ~ [.12 .07 .30 .45 .03 .04]: they differ a lot;
# prompt lookup continues 5 0 5 with 0 (and then 5), a deterministic branch next to the drawn ones
SAMPLED_PROMPT = [5, 0, 5]
N_SAMPLED = 600  # 8-12 s on a shared 2-core machine


@pytest.mark.stat
def test_sampled_tree_keeps_the_target_distribution(small_models):
    law = exact_pair_law(small_models[0], SAMPLED_PROMPT)
    counts, stats, with_lookup = sampled_pairs(small_models, SAMPLED_PROMPT, N_SAMPLED, pld=True)
    assert counts.sum() == N_SAMPLED
    assert with_lookup > N_SAMPLED / 2  # drawn children and prompt-lookup branches in one tree
    assert stats.tree_depth >= 2 * N_SAMPLED * 0.9  # first passes are two deep
    assert stats.accepted_per_position[1] > 0.05 * N_SAMPLED  # and whole branches get accepted
    p = pair_pvalue(counts, law)
    assert p > ALPHA, p
    p1 = chisquare(counts.sum(1), law.sum(1) * N_SAMPLED).pvalue  # the first token alone
    assert p1 > ALPHA, p1


# WRONG on purpose: after a rejected child the next sibling is tested against p itself, and the final
# token is drawn from p (the residual is never updated): the verifier tests' negative control (i)
verify_tree_no_residual = no_residual_update("p")


@pytest.mark.stat
def test_sampled_harness_rejects_a_wrong_verifier(small_models, monkeypatch):
    """Negative control: the same harness, with a verifier that skips the residual update, fails
    (p-values 1e-15 to 1e-22 over three seed ranges at 250 runs)."""
    law = exact_pair_law(small_models[0], [5])
    monkeypatch.setattr(verify_mod, "verify_tree", verify_tree_no_residual)
    counts, _, _ = sampled_pairs(small_models, [5], 250, pld=False)
    assert pair_pvalue(counts, law) < ALPHA


# ============================================================= 8. Engine API


@pytest.fixture
def engine(tiny_engine, monkeypatch):
    """The shared tiny engine with hand-made pass costs (measuring would time this machine, and
    costs.measure cannot run the 257-token tiny models); restored after each test."""
    monkeypatch.setattr(tiny_engine, "costs", CHEAP)
    return tiny_engine


def test_engine_tree_equals_autoregressive(engine, monkeypatch):
    plain = engine.generate("hello world", method="autoregressive", max_new_tokens=60)
    for kw in (
        {},
        dict(tree_width=2),
        dict(tree_depth=3),
        dict(tree_nodes=4),
        dict(tree_width=1, tree_depth=5, tree_nodes=5),
        dict(tree_width=3, tree_depth=2),
    ):
        out = engine.generate("hello world", method="tree", max_new_tokens=60, **kw)
        assert out.token_ids == plain.token_ids and out.text == plain.text, kw
        assert out.stats.method == "tree" and out.stats.new_tokens == len(out.token_ids)
        assert out.stats.target_forwards < 60
    monkeypatch.setattr(engine, "costs", EXPENSIVE)
    assert engine.generate("hello world", method="tree", max_new_tokens=60).token_ids == plain.token_ids
    sampled = [
        engine.generate("hello", method="tree", max_new_tokens=30, temperature=0.8, seed=3).token_ids for _ in range(2)
    ]
    assert sampled[0] == sampled[1] and len(sampled[0]) <= 30


def test_engine_stats_name_the_shape(engine):
    fixed = engine.generate("hello", method="tree", tree_width=2, tree_depth=3, tree_nodes=5, max_new_tokens=50)
    s = fixed.stats
    assert s.tree == {"width": 2, "depth": 3, "nodes": 5, "chosen_by_cost_model": []}
    assert s.method == "tree" and s.drafted <= 5 * s.target_forwards and s.tree_depth <= 3 * s.target_forwards
    assert len(s.drafted_per_position) <= 3
    assert s.expected_tokens_per_pass >= 1.0
    free = engine.generate("hello", method="tree", max_new_tokens=50).stats
    assert free.tree["chosen_by_cost_model"] == ["width", "depth", "nodes"]
    assert (free.tree["width"], free.tree["depth"], free.tree["nodes"]) == (MAX_WIDTH, MAX_DEPTH, MAX_NODES)
    part = engine.generate("hello", method="tree", tree_depth=2, max_new_tokens=20).stats
    assert part.tree["chosen_by_cost_model"] == ["width", "nodes"] and part.tree["depth"] == 2
    assert len(part.drafted_per_position) <= 2
    d = free.as_dict()
    for key in ("tree", "tree_depth", "mean_tree_nodes", "expected_tokens_per_pass"):
        assert key in d
    assert engine.generate("hello", method="draft", max_new_tokens=5).stats.tree is None


@pytest.mark.parametrize("name", ["tree_width", "tree_depth", "tree_nodes"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"], ids=repr)
def test_engine_rejects_bad_tree_shapes(engine, name, value):
    with pytest.raises(SpecDecodeError, match=name):
        engine.generate("hello", method="tree", max_new_tokens=5, **{name: value})


@pytest.mark.parametrize("method", ["draft", "pld", "autoregressive"])
def test_engine_tree_options_need_the_tree_method(engine, method):
    for name in ("tree_width", "tree_depth", "tree_nodes"):
        with pytest.raises(SpecDecodeError, match="tree"):
            engine.generate("hello", method=method, max_new_tokens=5, **{name: 2})


def test_engine_tree_stream_concatenates_to_text(engine):
    for kw in ({}, dict(temperature=1.0, seed=2), dict(tree_width=2, tree_depth=4)):
        stream = engine.stream("日本語 and more", method="tree", max_new_tokens=80, **kw)
        deltas = list(stream)
        assert "".join(deltas) == stream.result.text
        assert stream.result.stats.new_tokens == len(stream.result.token_ids)
    full = engine.generate("abc", method="autoregressive", max_new_tokens=60).text
    stop = full[20:23]
    stream = engine.stream("abc", method="tree", max_new_tokens=60, stop=[stop])
    deltas = list(stream)
    assert "".join(deltas) == stream.result.text == full[: full.index(stop)]
    assert stream.result.stats.finish_reason == "stop"
