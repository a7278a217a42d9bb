"""auto never pays for what it does not need. Pass costs at several context lengths, kept as
measured (a bigger pass may be cheaper); the planner choosing a cheaper larger pass; the draft model's
window (positions re-based, greedy output unchanged); lazy reading and the catch-up cost in auto's
decision to run the draft model."""

from __future__ import annotations

import json

import pytest
import torch

import specdecode.planning.costs as costs_mod
import specdecode.planning.tree as tree_mod
from helpers import CHEAP, GREEDY, run
from specdecode import Engine
from specdecode.backends import CachedLM
from specdecode.drafters import DraftModel
from specdecode.planning.costs import CostModel, load_or_measure, measure
from specdecode.planning.planner import TreeState, best_cut, draft_model_can_pay
from specdecode.planning.tree import TreeDrafter
from tiny import byte_tokenizer, tiny_model

V = 257


# ============================================================= 1. costs at context lengths


def test_costs_interpolate_by_context_length_and_continue_past_the_last():
    c = CostModel(
        {1: 1.0, 4: 2.0, 8: 4.0},
        {1: 0.1, 8: 0.5},
        target_at={1024: {1: 1.5, 4: 2.6}, 2048: {1: 2.0, 4: 3.2}},
        draft_at={1024: {1: 0.2, 8: 0.7}},
    )
    assert c.t(1) == 1.0 and c.t(1, 128) == 1.0 and c.t(1, 50) == 1.0  # the base table below 128
    assert c.t(1, 1024) == pytest.approx(1.5) and c.t(4, 2048) == pytest.approx(3.2)
    assert c.t(1, 576) == pytest.approx(1.25)  # half way from 128 to 1024
    assert c.t(1, 1536) == pytest.approx(1.75)
    assert c.t(1, 3072) == pytest.approx(2.5)  # linear past the last measured context
    # a pass bigger than the long tables hold: the base cost plus the long table's extra at its largest size
    assert c.t(8, 1024) == pytest.approx(4.0 + 0.6)
    assert c.d(1, 1024) == pytest.approx(0.2) and c.d(1) == pytest.approx(0.1)
    now = c.at(1024, 128)
    assert now.t(1) == pytest.approx(1.5) and now.t(4) == pytest.approx(2.6) and now.d(8) == pytest.approx(0.5)
    assert c.contexts == [128, 1024, 2048]
    assert CostModel({1: 1.0}).at(5000).t(1) == 1.0  # one context measured: no dependence on it


class _TimedLM:
    """An LM whose passes 'take' a given number of seconds on a fake clock (no sleeping)."""

    def __init__(self, seconds, clock, max_length=4096, per_context=0.0):
        self.seconds, self.clock, self.max_length, self.per_context = seconds, clock, max_length, per_context
        self.vocab_size, self.n = 1000, 0

    def reset(self):
        self.n = 0

    def rollback(self, length, path=()):
        self.n = length

    def forward(self, ids, last_only=False, parents=None):
        self.clock[0] += self.seconds(len(ids)) + self.per_context * self.n
        self.n += len(ids)
        return torch.zeros(1 if last_only else len(ids), self.vocab_size)

    def synchronize(self):
        pass

    def describe(self):
        return "timed-lm"

    def __len__(self):
        return self.n


@pytest.fixture
def fake_clock(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(costs_mod.time, "perf_counter", lambda: clock[0])
    return clock


def test_measure_keeps_a_cheaper_bigger_pass(fake_clock):
    """llama.cpp's repacked gemm takes tokens in groups of 4: T(3) > T(4) on some CPUs. The table keeps it."""
    kernel = {1: 0.085, 2: 0.125, 3: 0.165, 4: 0.130, 5: 0.200, 8: 0.250}
    lm = _TimedLM(lambda n: kernel.get(n, 0.5), fake_clock)
    times = measure(lm, [1, 2, 3, 4, 5, 8], repeats=2)
    assert times == pytest.approx(kernel)
    assert times[4] < times[3]  # not made monotone


def test_measure_times_every_size_when_bigger_passes_cost_less_per_token(fake_clock):
    """llama.cpp's tiles on a Zen 4: T(12) ~ 8.9 plain steps but T(16) ~ 7.5, T(32) ~ 14, T(64) ~ 27. No size is left
    out for costing many plain steps: the deep passes are where a right copy pays most."""
    kernel = {1: 1.0, 4: 2.8, 8: 6.9, 12: 8.9, 16: 7.5, 32: 14.0, 64: 27.0, 128: 54.0}
    lm = _TimedLM(lambda n: kernel[n] * 0.034, fake_clock)
    times = measure(lm, sorted(kernel), repeats=2)
    assert sorted(times) == sorted(kernel)
    assert times[16] < times[12] and times[64] / 64 < times[12] / 12


def test_measure_stops_adding_sizes_past_its_budget(fake_clock):
    """A slow machine (0.3 s a token) times the small passes and extrapolates the rest."""
    lm = _TimedLM(lambda n: 0.3 * n, fake_clock)
    times = measure(lm, [1, 2, 4, 8, 16, 32, 64], repeats=3, budget_s=30.0)
    assert sorted(times) == [1, 2, 4, 8, 16]  # 4.5 s up to 8, 9.3 s with 16: a 32-token pass would pass 10 s
    assert CostModel(times).t(64) == pytest.approx(0.3 * 64)  # the last slope, continued


def test_measure_at_a_longer_context(fake_clock):
    lm = _TimedLM(lambda n: 0.01 * n, fake_clock, per_context=1e-5)
    short, long = measure(lm, [1, 4], repeats=1), measure(lm, [1, 4], repeats=1, context=1024)
    assert long[1] == pytest.approx(0.01 + 1024e-5) and short[1] == pytest.approx(0.01 + 128e-5)


def test_load_or_measure_times_long_contexts_and_refuses_an_old_format(monkeypatch):
    calls = []

    def fake(lm, sizes, context=costs_mod.CONTEXT, **kw):
        calls.append((lm.describe(), context, tuple(sizes)))
        return {n: 0.01 * n + context * 1e-5 for n in sizes}

    monkeypatch.setattr(costs_mod, "measure", fake)
    clock = [0.0]
    target, draft = _TimedLM(lambda n: n, clock, max_length=8192), _TimedLM(lambda n: n, clock, max_length=8192)
    costs = load_or_measure(target, draft, progress=False)
    assert sorted(costs.target_at) == list(costs_mod.LONG_CONTEXTS) and sorted(costs.draft_at) == [1024]
    assert max(costs.draft) == costs_mod.DRAFT_READ  # the draft's catch-up pass is timed
    assert costs.t(1, 2048) == pytest.approx(0.01 + 2048e-5)
    assert all(
        max(s) <= costs_mod.LONG_SIZES or max(s) == costs_mod.DRAFT_READ  # the draft: its read pass
        for _, c, s in calls
        if c != costs_mod.CONTEXT
    )
    n = len(calls)
    assert load_or_measure(target, draft, progress=False).target_at == costs.target_at and len(calls) == n  # cached
    from specdecode.backends import cache_dir

    (path,) = (cache_dir() / "costs").glob("*.json")
    raw = json.loads(path.read_text())
    del raw["format"]  # a table of the older format (made monotone, one context): measured again
    path.write_text(json.dumps(raw))
    load_or_measure(target, draft, progress=False)
    assert len(calls) == 2 * n


def test_long_contexts_are_timed_only_within_the_budget(monkeypatch):
    """On a slow machine (bf16 torch on an AVX2-only CPU: a pass of one token ~0.3 s) the long-context tables
    would take many minutes; they are skipped, and the costs then do not depend on the context length."""
    contexts = []

    def fake(lm, sizes, context=costs_mod.CONTEXT, **kw):
        contexts.append((lm.describe(), context))
        return {n: lm.per_token * n for n in sizes}

    monkeypatch.setattr(costs_mod, "measure", fake)
    clock = [0.0]
    target, draft = _TimedLM(lambda n: n, clock, max_length=8192), _TimedLM(lambda n: n, clock, max_length=8192)
    target.per_token, draft.per_token = 0.03, 0.01  # 1024 tokens read in ~31 s, 2048 in ~61 s: only 1024 fits
    costs = load_or_measure(target, draft, progress=False)
    assert sorted(costs.target_at) == [1024] and sorted(costs.draft_at) == [1024]
    target.per_token = draft.per_token = 0.3
    target.describe = draft.describe = lambda: "slow-lm"  # another machine key: measured afresh
    slow = load_or_measure(target, draft, progress=False)
    assert slow.target_at == {} and slow.draft_at == {} and slow.t(1, 2048) == slow.t(1) == pytest.approx(0.3)
    assert all(c == costs_mod.CONTEXT for name, c in contexts if name == "slow-lm")
    assert costs_mod.within_budget({}, [1024], [1], 90.0) == []


# ============================================================= 2. the planner and the pass sizes

GROUPS_OF_4 = CostModel({1: 1.0, 2: 1.5, 3: 1.9, 4: 1.6, 5: 2.4, 8: 3.0})
MONOTONE = CostModel({1: 1.0, 2: 1.5, 3: 1.9, 4: 2.3, 5: 2.7, 8: 3.9})


def test_planner_fills_a_cheaper_bigger_pass():
    values = [0.6, 0.2, 0.15]  # ranked guesses: N nodes verify in a pass of N+1 tokens
    rate, n, e = best_cut(values, GROUPS_OF_4, 0.0, keep_all=False, max_nodes=32)
    assert n == 3 and e == pytest.approx(1.95)  # T(4) < T(3): a third guess rides for free
    rate, n, e = best_cut(values, MONOTONE, 0.0, keep_all=False, max_nodes=32)
    assert n == 1  # where the bigger pass costs more, the weak guesses are left out


ZEN4 = CostModel({1: 1.0, 2: 1.5, 4: 2.8, 8: 6.9, 12: 8.9, 16: 7.5, 32: 14.0, 64: 27.0})  # llama.cpp's tiles


def test_a_copy_is_cut_at_a_timed_pass_size():
    """A sure copy of 19 tokens: a pass of 20 would be interpolated between the timed 16 and 32 (a tiled kernel may
    cost more there); the ride takes the timed pass of 16, where a token costs least of the sizes it can fill."""
    values = [1.0] * 19
    assert best_cut(values, ZEN4, 0.0, keep_all=False, max_nodes=19)[1] == 19
    assert best_cut(values, ZEN4, 0.0, keep_all=False, max_nodes=19, measured_only=True)[1] == 15
    assert best_cut([1.0] * 70, ZEN4, 0.0, keep_all=False, max_nodes=70, measured_only=True)[1] == 63


def test_a_copy_rides_no_pass_longer_than_a_stream_may_pause(monkeypatch):
    """A sure copy where a pass of 128 tokens costs least per token but takes 1.6 s: the ride keeps to passes of at
    most MAX_PASS_S (here the timed 64, 1.4 s), so a stream never waits that long for its next token. Control: with
    the cap lifted it takes the 128."""
    from specdecode.drafters.copy import followed
    from specdecode.drafters.lookup import Lookup

    seconds = CostModel({1: 0.05, 16: 0.5, 32: 0.9, 64: 1.4, 128: 1.6})
    prompt, prediction = list(range(10)), list(range(1000, 1400))

    def ride_depth() -> int:
        drafter = TreeDrafter(
            None, costs=seconds, state=TreeState(), lookup=Lookup(None, None, copies=followed(prompt, prediction))
        )
        ids = prompt + prediction[:100]  # a hundred tokens copied cleanly
        drafter.prefill(ids)
        draft = drafter.propose(ids, 200, GREEDY)
        assert draft.strategy == "copy"
        return len(draft.tokens)

    assert tree_mod.MAX_PASS_S * 1.0 < seconds.t(128) and ride_depth() == 63
    monkeypatch.setattr(tree_mod, "MAX_PASS_S", 10.0)
    assert ride_depth() == 127


def test_lookup_tree_uses_the_cheaper_bigger_pass():
    """End to end through the tree drafter: a lookup chain of guesses is cut at 3 nodes (a pass of 4)
    where that pass is the cheaper one, at 1 node where passes grow monotonically."""
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8]  # the lookup proposes 9, 10, 11, 12, 5...
    sizes = {}
    for name, costs in (("groups", GROUPS_OF_4), ("monotone", MONOTONE)):
        drafter = TreeDrafter(None, costs=costs, state=TreeState())
        values = iter([0.6, 1 / 3, 0.75] + [0.5] * 30)  # path values 0.6, 0.2, 0.15, 0.075, ...
        drafter.state.lookup = lambda feature: next(values)  # the calibration's verdict, per guess in depth order
        drafter.prefill(prompt[:-1])
        draft = drafter.propose(prompt, 8, GREEDY)
        sizes[name] = len(draft.tokens)
    assert sizes == {"groups": 3, "monotone": 1}


# ============================================================= 3. the draft's window


@pytest.mark.parametrize("window", [3, 8, 20])
@pytest.mark.parametrize("method", ["draft", "tree", "auto"])
def test_draft_window_keeps_greedy_output(window, method):
    tok = byte_tokenizer()
    engine = Engine(tiny_model(0), tok, tiny_model(0), tok, draft_window=window)  # the draft = the target: it agrees
    engine.costs = CHEAP
    prompt = "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n"
    plain = engine.generate(prompt, method="autoregressive", max_new_tokens=60)
    out = engine.generate(prompt, method=method, max_new_tokens=60)
    assert out.token_ids == plain.token_ids
    assert out.stats.strategies.get("draft", 0) + out.stats.strategies.get("tree", 0) > 0
    assert engine.draft_model.offset > 0  # the view moved on
    assert len(engine.draft_model.lm) <= window + window // 2 + 8  # never more than 1.5 windows plus a tree


def test_draft_window_on_the_token_loop_rebases_positions():
    target, draft = tiny_model(0), tiny_model(1)
    prompt = list(range(30, 90))
    want, _ = run(CachedLM(target), None, prompt, 0, 50)
    drafter = DraftModel(draft, V, window=16)
    fed = []
    forward = drafter.lm.forward
    drafter.lm.forward = lambda ids, **kw: fed.append(len(drafter.lm) + len(ids)) or forward(ids, **kw)
    out, stats = run(CachedLM(target), drafter, prompt, 4, 50)
    assert out == want and stats.drafted > 0
    assert max(fed) <= 16 + 8 + 4  # the draft's own positions stay within the window (plus a chain)
    assert drafter.offset >= len(prompt) - 16


def test_short_context_draft_keeps_drafting_with_a_window():
    """A draft model whose context is shorter than the text drafts to the end: the window is at most
    half its context (without a window it stops once full: test_guards)."""
    tok = byte_tokenizer()
    engine = Engine(tiny_model(0), tok, tiny_model(0, max_pos=48), tok, draft_window=512)
    engine.costs = CHEAP
    assert engine.draft_model.view_window == 24
    plain = engine.generate("def add(a, b):\n", method="autoregressive", max_new_tokens=80)
    out = engine.generate("def add(a, b):\n", method="draft", max_new_tokens=80)
    assert out.token_ids == plain.token_ids
    # every step drafted (the first token came from the prompt's own pass, as greedy decoding's always does)
    assert out.stats.strategies == {"plain": 1, "draft": out.stats.target_forwards - 1}


def test_bad_draft_window(make_engine):
    from specdecode.errors import SpecDecodeError

    for bad in (0, -3, 2.5, True):
        with pytest.raises(SpecDecodeError, match="draft_window"):
            make_engine(draft_window=bad)


# ============================================================= 4. catch-up in auto's decision


@pytest.fixture
def step_clock(monkeypatch):
    clock = [0.0]

    def tick():
        clock[0] += 1.0
        return clock[0]

    monkeypatch.setattr(tree_mod.time, "perf_counter", tick)
    return clock


# a draft chain pays at short range here (a draft pass 0.05, a 5-token pass 1.3 plain steps), and
# reading costs the draft 0.01 per token: 1000 unread tokens cost 10 plain steps
READING = CostModel({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4, 32: 2.0}, {1: 0.05, 2: 0.06, 4: 0.07, 8: 0.1, 128: 1.28})


def _lazy(remaining, window=None, written=tree_mod.CATCHUP_WAIT):
    """A lazy drafter whose generation has already written `written` tokens (by default enough for any catch-up)."""
    drafter = TreeDrafter(
        DraftModel(tiny_model(0, max_pos=4096), V, window=window),
        costs=READING,
        state=TreeState(),
        lazy=True,
        remaining=remaining,
    )
    drafter.written = written
    return drafter


@pytest.mark.parametrize(
    "prompt_len,remaining,window,written,runs",
    [
        (20, 64, None, 0, True),  # little to read, much to gain
        (1000, 8, None, 16, False),  # reading 1000 tokens (10 plain steps) to save a fraction of 8 steps
        (1000, 400, None, 16, True),  # ... pays over 400 tokens
        (1000, 400, None, 15, False),  # ... but a long catch-up waits for the generation's first CATCHUP_WAIT tokens
        (500, 400, None, 0, True),  # a shorter one does not wait
        (1000, 8, 16, 0, True),  # with a window of 16 the draft reads 16 tokens, not 1000
    ],
)
def test_catch_up_cost_decides_whether_auto_runs_the_draft(step_clock, prompt_len, remaining, window, written, runs):
    ids = [(7 * i) % 200 for i in range(prompt_len)]
    drafter = _lazy(remaining, window, written)
    drafter.prefill(ids[:-1])
    assert len(drafter.model.lm) == 0  # lazy: nothing read up front
    draft = drafter.propose(ids, 4, GREEDY)
    ran = len(drafter.model.lm) > 0
    assert ran == runs, (draft.strategy, drafter.model.unread(len(ids)))
    if ran and window is None and prompt_len > 100:
        assert draft.catchup_s > 0  # read apart and timed
        # the catch-up (0.01 a token) is in what the step is modelled to cost
        assert draft.modelled_s > 0.009 * prompt_len


def test_catch_up_is_weighed_against_the_generations_own_rate_without_the_model(step_clock):
    """The (1000, 400) case above reads: its saving is reckoned against plain decoding. The same drafter after
    steps without the model that went at 8 tokens a plain step's time (a copy ridden) saves nothing by reading."""
    ids = [(7 * i) % 200 for i in range(1000)]
    riding = _lazy(400)
    riding.prefill(ids[:-1])
    riding.state.record_step(False, 80, 10.0, 10.0)  # 8 tokens in a plain step's modelled time
    riding.propose(ids, 4, GREEDY)
    assert len(riding.model.lm) == 0  # not read
    slow = _lazy(400)
    slow.prefill(ids[:-1])
    slow.state.record_step(False, 10, 10.0, 10.0)  # as slow as plain steps: the reading pays as before
    slow.propose(ids, 4, GREEDY)
    assert len(slow.model.lm) > 0


def test_catch_up_is_not_counted_in_the_measured_step_rate(step_clock):
    drafter = _lazy(400)
    ids = [(7 * i) % 200 for i in range(1000)]
    drafter.prefill(ids[:-1])
    draft = drafter.propose(ids, 4, GREEDY)
    assert draft.catchup_s == 1.0  # one tick of the step clock: the catch-up pass
    drafter.commit(len(ids), [], 3)
    tokens, seconds = drafter.state.measured[True]
    # from the step start (tick 1), less the catch-up
    assert tokens == 1 and seconds == pytest.approx(step_clock[0] - 1.0 - draft.catchup_s)


def test_auto_reads_the_prompt_lazily_and_states_the_catch_up(step_clock):
    tok = byte_tokenizer()
    engine = Engine(tiny_model(0, max_pos=2048), tok, tiny_model(0, max_pos=2048), tok, draft_window=None)
    engine.costs = READING
    prompt = "x = 1\n" * 150  # 900 tokens: a draft reading them all costs 9 plain steps
    plain = engine.generate(prompt, method="autoregressive", max_new_tokens=6)
    out = engine.generate(prompt, method="auto", max_new_tokens=6)
    assert out.token_ids == plain.token_ids
    assert out.stats.strategies.get("draft", 0) + out.stats.strategies.get("tree", 0) == 0  # never paid
    assert len(engine.draft_model.lm) == 0 and out.stats.catchup_s == 0.0


def test_can_pay_is_judged_at_every_measured_context():
    # at 128 tokens a 2-token pass costs 2 plain steps; at 2048 attention dominates and it costs 1.1
    costs = CostModel(
        {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0},
        {1: 0.05, 2: 0.06, 4: 0.07, 8: 0.1},
        target_at={2048: {1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0}},
    )
    assert draft_model_can_pay(costs, window=512)
    assert not draft_model_can_pay(CostModel(costs.target, costs.draft))


def test_auto_never_verifies_below_a_plain_step(step_clock, make_engine):
    """Lookup guesses are verified only where the modelled rate beats a plain step at this context:
    with passes that cost what they hold, nothing is verified."""
    engine = make_engine(draft=None)
    engine.costs = CostModel({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 32: 32.0})
    out = engine.generate("abcabcabcabcabcabc", method="auto", max_new_tokens=20)
    assert out.stats.drafted == 0 and out.stats.predicted_speedup == pytest.approx(1.0)


def test_one_burst_of_noise_does_not_end_the_table(fake_clock):
    """A pass timed past the cap once (another process was busy) is timed again before the sizes after
    it are given up."""
    kernel = {1: 0.04, 2: 0.07, 4: 0.12, 5: 0.15, 8: 0.25}
    calls = {5: 0}

    def seconds(n):
        if n == 5:
            calls[5] += 1
            if calls[5] == 1:
                return 0.6  # 15 plain steps, once
        return kernel.get(n, 0.5)

    times = measure(_TimedLM(seconds, fake_clock), [1, 2, 4, 5, 8], repeats=2)
    assert times == pytest.approx(kernel)
