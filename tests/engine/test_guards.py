"""Paths that could fail silently now fail loudly or behave as documented:

1. a model that ignores the KV cache it is given (transformers before 5.24 swallows `cache=`) is an error;
2. token trees under an attention implementation that may not honour a custom 4-D mask are refused
   before the model runs (chains keep working);
3. a greedy tree's shapes and output do not depend on what the Engine generated before;
4. stats cut at a stop string count only the accepted draft tokens that were emitted (and at EOS);
5. a draft model with a shorter context than the target's drafts while it fits, then the target goes
   on plainly (no crash, no position past the draft's context).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AttentionInterface, GPT2Config, GPT2LMHeadModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from helpers import CHEAP, run
from specdecode import Engine, SpecDecodeError, Stats
from specdecode.backends import CachedLM
from specdecode.drafters import DraftModel
from tiny import byte_tokenizer, tiny_model, tiny_sliding_model

V = 257


def engine_with(target, draft=None, costs=CHEAP, **kw) -> Engine:
    tok = byte_tokenizer()
    engine = Engine(target, tok, draft, tok if draft is not None else None, **kw)
    engine.costs = costs  # hand-made: no measurement
    return engine


# ============================================================ 1. the cache must be the one we pass


def test_installed_transformers_takes_cache_keyword():
    """pyproject's floor is the first release whose causal LMs take `cache=` (5.24: `past_key_values`
    before); the installed one must satisfy it."""
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    floor = re.search(r'"transformers>=([0-9.]+),<6"', text).group(1)
    assert Version(floor) >= Version("5.24")
    assert Version(transformers.__version__) >= Version(floor)
    assert "cache" in inspect.signature(transformers.Qwen2ForCausalLM.forward).parameters


def _ignore_cache(model):
    """What an older transformers does with `cache=`: swallow it and build a throwaway cache."""
    forward = model.forward
    calls = []

    def wrapped(*args, cache=None, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    model.forward = wrapped
    return calls


def test_model_that_ignores_the_cache_is_an_error():
    model = tiny_model(0)
    _ignore_cache(model)
    lm = CachedLM(model)
    with pytest.raises(
        SpecDecodeError,
        match=r"did not use the KV cache.*grew by 0 entries for 3 tokens.*"
        r"transformers>=5\.24",
    ):
        lm.forward([1, 2, 3])
    assert len(lm) == 0  # nothing recorded as cached
    # through the engine: the prefill already fails, before any output
    engine = engine_with(model)
    with pytest.raises(SpecDecodeError, match="did not use the KV cache"):
        engine.generate("hello", method="autoregressive", max_new_tokens=5)


def test_the_cache_check_passes_on_every_kind_of_pass():
    lm = CachedLM(tiny_model(0))
    lm.forward([1, 2, 3, 4])  # causal
    lm.forward([5, 6, 7], parents=[3, 4, 4])  # a tree
    lm.rollback(5, [6])
    lm.forward([8], last_only=True)
    assert len(lm) == lm.cache.get_seq_length() == 7


# ============================================================ 2. tree masks need eager or sdpa


def test_tree_pass_refused_under_flash_attention_before_the_model_runs():
    model = tiny_model(0)
    model.config._attn_implementation = "flash_attention_2"  # flash-attn need not be installed
    calls = _count_calls(model)
    lm = CachedLM(model)
    with pytest.raises(SpecDecodeError, match=r"'flash_attention_2'.*attn_implementation=\"sdpa\""):
        lm.forward([1, 2, 3], parents=[-1, 0, 0])
    assert calls == [] and len(lm) == 0


def _count_calls(model):
    forward = model.forward
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    model.forward = wrapped
    return calls


@pytest.fixture
def custom_attention():
    """An attention implementation specdecode does not know (here it is sdpa under another name)."""
    name = "specdecode_test_attention"
    AttentionInterface.register(name, sdpa_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)  # its causal mask, built by transformers
    return name


def test_unknown_attention_runs_chains_but_refuses_trees(custom_attention):
    target, draft = tiny_model(0), tiny_model(1)
    plain = engine_with(tiny_model(0)).generate("hello world", method="autoregressive", max_new_tokens=30)
    for m in (target, draft):
        m.config._attn_implementation = custom_attention
    engine = engine_with(target, draft)
    for method in ("autoregressive", "draft", "pld"):
        out = engine.generate("hello world", method=method, gamma=3, max_new_tokens=30)
        assert out.token_ids == plain.token_ids
    calls = _count_calls(target)
    with pytest.raises(SpecDecodeError, match=custom_attention):
        engine.generate("hello world", method="tree", tree_width=2, tree_depth=3, max_new_tokens=30)
    assert calls == []  # refused before any model work
    # auto, the default, drafts chains only (never a tree pass) instead of failing halfway
    out = engine.generate("hello world", method="auto", max_new_tokens=30)
    assert out.token_ids == plain.token_ids and out.stats.strategies.get("tree", 0) == 0
    assert out.stats.strategies.get("draft", 0) > 0 and calls
    with pytest.raises(SpecDecodeError, match=custom_attention):  # a tree pass itself is refused too
        engine.target.forward([1, 2], parents=[-1, -1])
    # eager and sdpa honour the mask: trees run
    for impl in ("eager", "sdpa"):
        for m in (target, draft):
            m.config._attn_implementation = impl
        out = engine.generate("hello world", method="tree", tree_width=2, tree_depth=3, max_new_tokens=30)
        assert out.token_ids == plain.token_ids and out.stats.strategies.get("tree", 0) > 0


def test_sliding_window_target_auto_drafts_chains_and_tree_is_refused_up_front():
    target = tiny_sliding_model()
    engine = engine_with(target, tiny_model(1))
    plain = engine.generate("hello world", method="autoregressive", max_new_tokens=40)
    calls = _count_calls(target)
    with pytest.raises(SpecDecodeError, match="sliding-window"):
        engine.generate("hello world", method="tree", max_new_tokens=40)
    assert calls == []
    out = engine.generate("hello world", method="auto", max_new_tokens=40)
    assert out.token_ids == plain.token_ids and out.stats.strategies.get("tree", 0) == 0


# ============================================================ 3. no state across generations


@pytest.fixture
def step_clock(monkeypatch):
    """The adaptive planner compares measured wall-clock rates of steps with and without the draft
    model (tree.TreeDrafter._learn_rate): a clock that advances 1 s per reading makes them (and so
    the shapes) depend on the tokens each step emitted only, not on this machine's load."""
    import itertools
    import types

    import specdecode.planning.tree as tree_mod

    ticks = itertools.count()
    monkeypatch.setattr(tree_mod, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))), raising=False)


def _trace(monkeypatch):
    """Every target pass's draft (tokens and parents), as the engine records it."""
    passes = []
    record = Stats.record

    def logged(self, draft, *args, **kwargs):
        passes.append((tuple(draft.tokens), None if draft.parents is None else tuple(draft.parents)))
        return record(self, draft, *args, **kwargs)

    monkeypatch.setattr(Stats, "record", logged)
    return passes


def _shape(out):
    s = out.stats
    return (
        out.token_ids,
        s.mean_tree_nodes,
        s.tree_depth,
        s.drafted,
        s.accepted,
        s.strategies,
        round(s.expected_tokens, 9),
    )


@pytest.mark.parametrize("method", ["tree", "auto"])
def test_greedy_tree_does_not_depend_on_earlier_generations(monkeypatch, step_clock, method):
    passes = _trace(monkeypatch)
    prompt, kw = "the quick brown fox", dict(method=method, max_new_tokens=60)

    fresh = engine_with(tiny_model(0), tiny_model(1))
    alone = fresh.generate(prompt, **kw)
    alone_passes = list(passes)
    assert alone.stats.mean_tree_nodes > 1  # non-trivial trees

    used = engine_with(tiny_model(0), tiny_model(1))
    for other in ("hello hello hello hello", "abcabcabcabc", "0123456789"):
        used.generate(other, **kw)
    passes.clear()
    after = used.generate(prompt, **kw)
    assert passes == alone_passes  # the same tree at every step
    assert _shape(after) == _shape(alone)
    # and again on the engine that just ran it
    passes.clear()
    assert _shape(fresh.generate(prompt, **kw)) == _shape(alone) and passes == alone_passes


# ============================================================ 4. stats at a stop string and at EOS

GAMMA = 4  # with the target as its own draft every pass accepts all 4 and emits 5 tokens


def _self_drafting_engine():
    model = tiny_model(0)
    return engine_with(model, model)


def _mid_pass_cut(ids, decode):
    """A 3-token stop string whose first occurrence ends on a draft token in the middle of a pass
    (pass-relative index 1-2 of 0-4, 4 being the bonus: drafted tokens after it are cut), and that index.
    Greedy: token 0 comes from the prompt's own pass (engine._prefill), passes of GAMMA + 1 from token 1."""
    for k in range(2 * (GAMMA + 1), len(ids) - GAMMA - 1):
        if (k - 1) % (GAMMA + 1) not in (1, 2):
            continue
        stop = decode(ids[k - 2 : k + 1])
        if len(stop) == 3 and stop.isprintable() and stop in decode(ids[: k + 1]) and stop not in decode(ids[:k]):
            return stop, k
    raise AssertionError("no mid-pass stop string in this output")


def _expected_accepted(n_emitted, passes):
    """Accepted draft tokens (total, by position) when every pass accepts GAMMA and the output is cut
    to n_emitted tokens; the first pass (the prompt's: greedy decoding's first token) drafted nothing."""
    per_position = [0] * GAMMA
    for p in range(passes - 1):
        kept = min(GAMMA, max(0, n_emitted - 1 - p * (GAMMA + 1)))
        for i in range(kept):
            per_position[i] += 1
    return sum(per_position), per_position


def test_stop_string_in_the_middle_of_a_pass_cuts_the_stats():
    engine = _self_drafting_engine()
    full = engine.generate("def f(x):", method="draft", gamma=GAMMA, max_new_tokens=81)
    s = full.stats
    # precondition: acceptance 1 (the first token from the prompt's pass, then passes of GAMMA + 1)
    assert s.accepted == s.drafted == GAMMA * (s.target_forwards - 1) and s.strategies["plain"] == 1
    stop, k = _mid_pass_cut(full.token_ids, engine.decode)

    out = engine.generate("def f(x):", method="draft", gamma=GAMMA, max_new_tokens=81, stop=stop)
    s = out.stats
    assert s.finish_reason == "stop" and out.token_ids == full.token_ids[: k + 1]
    assert s.new_tokens == k + 1 and s.target_forwards == (k - 1) // (GAMMA + 1) + 2
    accepted, per_position = _expected_accepted(k + 1, s.target_forwards)
    assert s.accepted == accepted < s.drafted == GAMMA * (s.target_forwards - 1)
    assert s.accepted_per_position == per_position and sum(s.accepted_per_position) == s.accepted
    # accepted never exceeds the emitted tokens that came from drafts (all but one bonus per full pass)
    assert s.accepted <= s.new_tokens - (s.target_forwards - 1)
    assert s.as_dict()["accepted"] == accepted and "_passes" not in s.as_dict()


def test_eos_in_the_middle_of_a_pass_cuts_the_stats():
    """The loop counts accepted tokens up to an EOS (speculative_decode counts min(len(path), len(new))); kept so."""
    engine = _self_drafting_engine()
    full = engine.generate("def f(x):", method="draft", gamma=GAMMA, max_new_tokens=80)
    ids = full.token_ids
    k = next(
        k
        for k in range(GAMMA + 1, len(ids) - GAMMA - 1)
        if (k - 1) % (GAMMA + 1) in (1, 2, 3) and ids[k] not in ids[:k]
    )
    engine.eos_ids = {ids[k]}
    out = engine.generate("def f(x):", method="draft", gamma=GAMMA, max_new_tokens=80)
    s = out.stats
    assert s.finish_reason == "eos" and out.token_ids == ids[: k + 1] and s.new_tokens == k + 1
    accepted, per_position = _expected_accepted(k + 1, s.target_forwards)
    assert s.accepted == accepted and s.accepted_per_position == per_position


def test_stop_cut_across_passes_and_a_tree():
    """Stats.truncate on its own: a cut that drops whole passes, and tree passes (accepted by depth)."""
    stats = Stats()
    from specdecode.drafters import Draft

    tree = Draft([1, 2, 3, 4], None, parents=[-1, -1, 0, 2])  # depth 3
    stats.record(tree, 3, 4)  # emits 4: depth 1, 2, 3 accepted + bonus
    stats.record(Draft([5, 6], None), 2, 3)
    stats.record(Draft([7], None), 0, 1)
    stats.new_tokens = 8
    stats.truncate(2)  # keeps the first two accepted tokens of the first pass only
    assert stats.accepted == 2 and stats.accepted_per_position == [1, 1, 0]
    assert stats.drafted == 7 and stats.target_forwards == 3 and stats.new_tokens == 2


# ============================================================ 5. a draft with a shorter context


def _positions_watch(lm: CachedLM):
    """Fail at once if the draft model is ever fed a position outside its context."""
    forward = lm.forward
    seen = []

    def watched(new_ids, last_only=False, parents=None):
        out = forward(new_ids, last_only=last_only, parents=parents)
        top = max([lm.trunk - 1] + lm.pos)
        seen.append(top)
        assert top < lm.max_length, f"draft fed position {top} beyond its context of {lm.max_length}"
        return out

    lm.forward = watched
    return seen


def _gpt2_draft(n_positions: int) -> GPT2LMHeadModel:
    """Learned absolute positions: past n_positions an index error (the obscure crash)."""
    torch.manual_seed(1)
    config = GPT2Config(
        vocab_size=V, n_positions=n_positions, n_embd=64, n_layer=2, n_head=4, bos_token_id=256, eos_token_id=256
    )
    return GPT2LMHeadModel(config).float().eval()


@pytest.mark.parametrize("draft_kind", ["qwen2", "gpt2"])
@pytest.mark.parametrize(
    "method,kw",
    [("draft", dict(gamma=4)), ("tree", dict(tree_width=2, tree_depth=4)), ("auto", {})],
    ids=["draft", "tree", "auto"],
)
def test_short_draft_context_drafts_then_goes_on_plainly(step_clock, draft_kind, method, kw):
    limit = 48
    # the qwen2 draft is the target's own weights (it agrees, so even auto keeps running it to the end of
    # its context); the random gpt2 draft hardly agrees, and auto may stop running it on its own
    draft = tiny_model(0, max_pos=limit) if draft_kind == "qwen2" else _gpt2_draft(limit)
    engine = engine_with(tiny_model(0), draft, draft_window=None)  # no window: the draft's context fills up
    seen = _positions_watch(engine.draft_model.lm)
    prompt = "def add(a, b):\n"  # 15 tokens: the draft fits at first, not after ~33 more
    plain = engine.generate(prompt, method="autoregressive", max_new_tokens=80)
    out = engine.generate(prompt, method=method, max_new_tokens=80, **kw)
    assert out.token_ids == plain.token_ids and len(out.token_ids) == 80
    assert out.stats.finish_reason == "length"
    assert seen and max(seen) < limit  # never past its context
    if method != "auto" or draft_kind == "qwen2":
        assert max(seen) >= limit - 4  # used up to the end of its context
    assert out.stats.drafted > 0
    draft_passes = out.stats.strategies.get("draft", 0) + out.stats.strategies.get("tree", 0)
    assert 0 < draft_passes < out.stats.target_forwards  # the draft ran, then the target went on


def test_prompt_longer_than_the_draft_context():
    engine = engine_with(tiny_model(0), _gpt2_draft(16), draft_window=None)
    prompt = "a prompt that is longer than the draft model's context"
    plain = engine.generate(prompt, method="autoregressive", max_new_tokens=20)
    for method in ("draft", "tree"):
        out = engine.generate(prompt, method=method, max_new_tokens=20)
        assert out.token_ids == plain.token_ids
        assert out.stats.strategies.get("draft", 0) + out.stats.strategies.get("tree", 0) == 0
    assert len(engine.draft_model.lm) == 0  # never fed


def test_short_draft_context_on_the_token_loop():
    """The same through speculative_decode directly (the chain drafter's room caps gamma)."""
    target, draft = tiny_model(0), tiny_model(1, max_pos=40)
    want, _ = run(CachedLM(target), None, list(range(30, 60)), 0, 40)
    drafter = DraftModel(draft, V, window=None)
    seen = _positions_watch(drafter.lm)
    out, stats = run(CachedLM(target), drafter, list(range(30, 60)), 6, 40)
    assert out == want and max(seen) < 40 and stats.drafted > 0
