"""End to end on tiny random fp32 models: speculative output equals plain decoding, token for token."""

import pytest
import torch

from helpers import GREEDY, run
from specdecode import Engine, SamplingParams, SpecDecodeError, Stats, speculative_decode
from specdecode.backends import CachedLM
from specdecode.drafters import DraftModel, PromptLookup
from tiny import byte_tokenizer, tiny_model, tiny_sliding_model


@pytest.fixture(scope="module")
def models():
    return tiny_model(0), tiny_model(1)


@pytest.fixture(scope="module")
def plain_of(models):
    """plain_of(prompt, n): the target's greedy plain decoding (autoregressive, no drafter) of n tokens after prompt,
    run once per module for each (prompt, n) that the greedy-equality tests compare with."""
    done = {}

    def plain(prompt, n):
        key = (tuple(prompt), n)
        if key not in done:
            done[key] = run(CachedLM(models[0]), None, list(prompt), 0, n)[0]
        return list(done[key])

    return plain


PROMPTS = [[5, 17, 42, 99, 3], list(range(30, 60)), [7]]


def check_stats(stats, out, n):
    assert stats.new_tokens == len(out) == n
    assert stats.accepted <= stats.drafted
    assert sum(stats.accepted_per_position) == stats.accepted
    assert sum(stats.drafted_per_position) == stats.drafted
    assert stats.target_forwards * 1 <= len(out)
    assert stats.new_tokens == stats.accepted + stats.target_forwards  # one residual/bonus per pass, no EOS cut


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_draft_equals_target_draft(models, plain_of, prompt):
    target_model, _ = models
    plain = plain_of(prompt, 200)
    spec, stats = run(CachedLM(target_model), DraftModel(target_model, 257), prompt, 5, 200)
    assert spec == plain
    check_stats(stats, spec, 200)
    assert stats.accepted == stats.drafted  # draft = target: everything is accepted


@pytest.mark.parametrize("gamma", [1, 2, 3, 4, 5, 6, 7, 8])
def test_greedy_unrelated_draft_equals_plain(models, plain_of, gamma):
    """A rejection at nearly every step, rolled back 300 times; the two prompts take turns over the gammas."""
    target_model, draft_model = models
    prompt = PROMPTS[gamma % 2]
    plain = plain_of(prompt, 300)
    spec, stats = run(CachedLM(target_model), DraftModel(draft_model, 257), prompt, gamma, 300)
    assert spec == plain
    check_stats(stats, spec, 300)
    assert stats.target_forwards < 300 or stats.accepted == 0


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_pld_equals_plain(models, plain_of, gamma):
    target_model, _ = models
    for prompt in PROMPTS:
        plain = plain_of(prompt, 300)
        spec, stats = run(CachedLM(target_model), PromptLookup(), prompt, gamma, 300)
        assert spec == plain
        assert stats.new_tokens == 300 and stats.accepted <= stats.drafted


def test_pld_accepts_on_repetitive_text(models):
    target_model, _ = models
    # a random model falls into loops; prompt lookup must then win
    _, stats = run(CachedLM(target_model), PromptLookup(), PROMPTS[1], 4, 300)
    assert stats.accepted > 0 and stats.target_forwards < 300


def test_draft_cache_stays_in_step(models):
    """After every step both caches hold exactly committed tokens (target: all but the last)."""
    target_model, draft_model = models
    target, drafter = CachedLM(target_model), DraftModel(draft_model, 257)
    committed = list(PROMPTS[0])
    stats = Stats()
    for new in speculative_decode(
        target,
        drafter,
        committed[:],
        gamma=4,
        params=GREEDY,
        max_new_tokens=60,
        eos_ids=set(),
        generator=torch.Generator(),
        stats=stats,
    ):
        committed += new
        assert target.ids == committed[:-1]
        assert drafter.lm.ids == committed[: len(drafter.lm.ids)]
        assert len(drafter.lm.ids) >= len(committed) - 2


def test_rollback_equals_fresh_prefill(models):
    """KV rollback invariant: logits after a rejection equal a fresh prefill of the accepted text."""
    target_model, _ = models
    prefix, draft = [5, 17, 42, 99, 3, 8], [11, 12, 13, 14, 15]
    lm = CachedLM(target_model)
    lm.forward(prefix[:-1])
    lm.forward([prefix[-1]] + draft)  # verify pass over the whole draft
    for keep in [4, 2, 0]:  # accept 4, then 2, then 0 draft tokens: roll back further each time
        lm.rollback(len(prefix) + keep)
        got = lm.forward([77])[-1]
        fresh = CachedLM(target_model)
        want = fresh.forward(prefix + draft[:keep] + [77])[-1]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        lm.rollback(len(prefix) + keep)
        assert lm.ids == prefix + draft[:keep]
    with pytest.raises(ValueError):
        lm.rollback(len(lm) + 1)


def test_eos_inside_draft_stops_there(models):
    target_model, _ = models
    plain, _ = run(CachedLM(target_model), None, PROMPTS[0], 0, 100)
    eos = plain[37]  # pretend the 38th token is EOS: both methods must stop right after it
    cut = plain[: plain.index(eos) + 1]
    for drafter in (DraftModel(target_model, 257), PromptLookup()):
        spec, stats = run(CachedLM(target_model), drafter, PROMPTS[0], 6, 100, eos={eos})
        assert spec == cut
        assert stats.finish_reason == "eos" and stats.new_tokens == len(cut)


@pytest.mark.parametrize("n", [1, 2, 7, 13])
def test_max_new_tokens_inside_draft(models, n):
    target_model, _ = models
    spec, stats = run(CachedLM(target_model), DraftModel(target_model, 257), PROMPTS[0], 8, n)
    plain, _ = run(CachedLM(target_model), None, PROMPTS[0], 0, n)
    assert spec == plain and len(spec) == n and stats.finish_reason == "length"


def test_context_limit(models):
    small = tiny_model(0, max_pos=40)
    out, stats = run(CachedLM(small), DraftModel(small, 257), list(range(30, 60)), 8, 100)
    assert len(out) == 10 and stats.finish_reason == "length"
    with pytest.raises(SpecDecodeError, match="context"):
        run(CachedLM(small), None, list(range(50)), 4, 10)


def test_sampling_is_reproducible_with_seed(models):
    target_model, draft_model = models
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95)
    a, _ = run(CachedLM(target_model), DraftModel(draft_model, 257), PROMPTS[0], 4, 80, params, seed=3)
    b, _ = run(CachedLM(target_model), DraftModel(draft_model, 257), PROMPTS[0], 4, 80, params, seed=3)
    c, _ = run(CachedLM(target_model), DraftModel(draft_model, 257), PROMPTS[0], 4, 80, params, seed=4)
    assert a == b and a != c


@pytest.mark.stat  # 3000 sampled generations (about a minute)
def test_sampled_first_token_follows_target(models):
    """Engine-level check of losslessness: the first sampled token of draft decoding (many seeds) has
    the target's distribution. Three new tokens with gamma=2, so the first target pass really verifies
    two drafted tokens (with max_new_tokens=1 nothing would be drafted). The joint law of the first
    three tokens of every method, 10^5 samples each, is in test_lossless_engine."""
    from scipy.stats import chisquare

    from specdecode.sampling import probs_from_logits

    target_model, draft_model = models
    params = SamplingParams(temperature=1.5, top_k=8)
    prompt = PROMPTS[0]
    p = probs_from_logits(CachedLM(target_model).forward(prompt)[-1], params)
    target, drafter = CachedLM(target_model), DraftModel(draft_model, 257)
    counts = torch.zeros(257)
    N = 3000
    for seed in range(N):
        out, stats = run(target, drafter, prompt, 2, 3, params, seed=seed)
        assert stats.drafted >= 2
        counts[out[0]] += 1
    support = p > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support].numpy(), (p[support] * N).numpy()).pvalue > 1e-6


# -- Engine API (text level) -------------------------------------------------------------------


def test_engine_generate_text_and_stats(tiny_engine):
    a = tiny_engine.generate("hello world", method="autoregressive", max_new_tokens=40)
    for method in ("draft", "pld"):
        b = tiny_engine.generate("hello world", method=method, gamma=3, max_new_tokens=40)
        assert b.token_ids == a.token_ids and b.text == a.text
        s = b.stats
        assert s.new_tokens == len(b.token_ids) and s.accepted <= s.drafted and s.wall_s > 0
        d = s.as_dict()
        for key in (
            "new_tokens",
            "target_forwards",
            "drafted",
            "accepted",
            "acceptance_rate",
            "mean_accepted_tokens",
            "accepted_per_position",
            "wall_s",
            "tokens_per_second",
            "draft_s",
            "verify_s",
        ):
            assert key in d


def test_stream_concatenates_to_text_and_never_splits_characters(make_engine):
    engine = make_engine(2, draft=None)
    # a byte tokenizer emits multi-byte UTF-8 characters in pieces: the stream must hold them back
    deltas = list(engine.stream("日本語のテキスト", method="pld", max_new_tokens=120, temperature=1.0, seed=1))
    result = engine.generate("日本語のテキスト", method="pld", max_new_tokens=120, temperature=1.0, seed=1)
    assert "".join(deltas) == result.text
    assert all("\ufffd" not in d[-1:] or d == result.text[-len(d) :] for d in deltas)


def test_stop_strings(tiny_engine):
    full = tiny_engine.generate("abc", method="autoregressive", max_new_tokens=60)
    stop = full.text[20:23]
    assert len(stop) == 3
    idx = full.text.index(stop)
    for method in ("autoregressive", "draft", "pld"):
        stream = tiny_engine.stream("abc", method=method, max_new_tokens=60, stop=[stop])
        deltas = list(stream)
        r = stream.result
        assert r.text == full.text[:idx] == "".join(deltas)
        assert r.stats.finish_reason == "stop"
        assert r.token_ids == full.token_ids[: len(r.token_ids)] and r.stats.new_tokens == len(r.token_ids)
        assert stop in tiny_engine.decode(r.token_ids) and stop not in tiny_engine.decode(r.token_ids[:-1])


def test_chat_template(tiny_engine):
    ids = tiny_engine.encode([{"role": "user", "content": "hi"}])
    assert tiny_engine.decode(ids) == "<user>hi\n<assistant>"
    assert tiny_engine.encode("hi", chat=True) == ids
    assert tiny_engine.generate("hi", chat=True, max_new_tokens=5).stats.prompt_tokens == len(ids)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt=""), "empty"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=-3), "max_new_tokens"),
        (dict(gamma=0), "gamma"),
        (dict(gamma=-1), "gamma"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(method="beam"), "method"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_input_is_a_clear_error(tiny_engine, kwargs, match):
    kwargs = {"prompt": "hello", "method": "draft", **kwargs}
    with pytest.raises(SpecDecodeError, match=match):
        tiny_engine.generate(kwargs.pop("prompt"), **kwargs)


def test_draft_method_without_draft_model(make_engine):
    engine = make_engine(draft=None)
    with pytest.raises(SpecDecodeError, match="draft model"):
        engine.generate("hi", method="draft")


def test_incompatible_tokenizers():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, "[UNK]")))
    with pytest.raises(SpecDecodeError, match="tokenizers differ"):
        Engine(tiny_model(0), byte_tokenizer(), tiny_model(1), other)


def test_draft_vocab_padding_is_aligned():
    """A draft whose embedding is padded to a different size still proposes only target tokens."""
    tok = byte_tokenizer()
    engine = Engine(tiny_model(0), tok, tiny_model(1, vocab_size=300), tok)
    a = engine.generate("hello", method="autoregressive", max_new_tokens=50)
    b = engine.generate("hello", method="draft", gamma=4, max_new_tokens=50)
    assert a.token_ids == b.token_ids
    c = engine.generate("hello", method="draft", gamma=4, max_new_tokens=50, temperature=1.0, seed=0)
    assert max(c.token_ids) < 257


def test_sliding_window_model_rolls_back_past_the_window():
    """Sliding-window layers drop old states once full; rollback must still work past the window."""
    model = tiny_sliding_model()
    plain, _ = run(CachedLM(model), None, PROMPTS[1], 0, 80)
    spec, stats = run(CachedLM(model), DraftModel(tiny_model(1), 257), PROMPTS[1], 4, 80)
    assert spec == plain and stats.rejections > 0


def test_two_streams_on_one_engine_never_corrupt_each_other(make_engine):
    """The models hold one KV cache each: a second stream that starts while one is open is refused with a
    clear error (the open one goes on undisturbed); a stream that ended, was closed or was dropped frees it."""
    import gc

    engine = make_engine()
    ref = engine.generate("abc", method="draft", max_new_tokens=24)
    a = iter(engine.stream("abc", method="draft", max_new_tokens=24))
    first = next(a)
    with pytest.raises(SpecDecodeError, match="another stream that is still open"):
        list(engine.stream("xyz", method="pld", max_new_tokens=8))
    with pytest.raises(SpecDecodeError, match="another stream that is still open"):
        engine.tree_costs()  # measuring would run the models too
    assert first + "".join(a) == ref.text  # the open stream was not disturbed
    other = engine.generate("xyz", method="pld", max_new_tokens=8)  # it ended: the Engine is free
    closed = iter(engine.stream("abc", method="draft", max_new_tokens=24))
    next(closed)
    closed.close()
    assert engine.generate("xyz", method="pld", max_new_tokens=8).text == other.text
    dropped = iter(engine.stream("abc", method="draft", max_new_tokens=24))
    next(dropped)
    del dropped
    gc.collect()
    assert engine.generate("abc", method="draft", max_new_tokens=24).text == ref.text


def _watched(engine, log):
    """Log what surrounds a generation where the LM and the Engine show it: the lease's lock, history.add, the target's
    padding, owner and release."""

    class Lock:
        def __init__(self, lock):
            self.lock = lock

        def acquire(self, blocking=True):
            got = self.lock.acquire(blocking)
            log.append("lease +" if got else "lease busy")
            return got

        def release(self):
            log.append("lease -")
            self.lock.release()

    class Watched(type(engine.target)):
        @property
        def pad_rows(self):
            return self.__dict__.get("_pad", 1)

        @pad_rows.setter
        def pad_rows(self, rows):
            log.append(f"pad {rows}")
            self.__dict__["_pad"] = rows

        @property
        def owner(self):
            return self.__dict__.get("_owner")

        @owner.setter
        def owner(self, scope):
            log.append(f"owner {scope!r}")
            self.__dict__["_owner"] = scope

        def release(self):
            log.append("release")
            super().release()

    engine.target.__class__ = Watched
    engine.lease._lock = Lock(engine.lease._lock)
    add = engine.history.add
    engine.history.add = lambda out: log.append(f"history {len(out)}") or add(out)


@pytest.mark.parametrize("end", ["exhausted", "closed", "error"])
@pytest.mark.parametrize("mode", ["prompt cache", "exact padded"])
def test_what_surrounds_a_generation_is_left_in_reverse_however_it_ends(mode, end):
    """The lease, the history, exact mode's padding and the prompt cache's ownership are entered at the first step in
    that order and left in the reverse, whether the steps run out, the stream is closed between steps (a client gone)
    or a pass fails (the cache then left to nobody)."""
    from specdecode.exactness import ExactLimits

    tok = byte_tokenizer()
    engine = Engine(tiny_model(0), tok, history_tokens=1000, prompt_cache=mode == "prompt cache")
    kwargs = {"exact": True} if mode == "exact padded" else {}
    engine._exact_limits = ExactLimits(max_pass=1, trees=False, max_context=10**6, pad_rows=2)
    log: list[str] = []
    _watched(engine, log)
    forward, passes = engine.target.forward, []

    def failing(*a, **k):  # the third pass (a decoding step) fails where asked
        passes.append(1)
        if end == "error" and len(passes) == 3:
            raise RuntimeError("a pass failed")
        return forward(*a, **k)

    engine.target.forward = failing
    steps = engine.stream("abc", method="autoregressive", max_new_tokens=6, **kwargs).steps  # committed ids
    assert log == []  # nothing is taken before the first step
    emitted = []
    if end == "error":
        with pytest.raises(RuntimeError, match="a pass failed"):
            for new in steps:
                emitted += new
    else:
        emitted += next(steps)
        if end == "closed":
            steps.close()
        for new in steps:
            emitted += new
    assert len(emitted) == {"exhausted": 6, "closed": 1, "error": 2}[end]  # (the prompt's read yields a token)
    enter = ["lease +"] + (["pad 2"] if mode == "exact padded" else []) + ["owner None"]
    scope = "" if mode == "prompt cache" else None
    leave = {"prompt cache": ["owner None"] * (end == "error") + ["release"], "exact padded": ["pad 1"]}[mode]
    assert log == enter + [f"owner {scope!r}"] + leave + [f"history {len(emitted)}", "lease -"], log
    assert engine.target.pad_rows == 1 and engine.target.owner == (None if end == "error" else scope)


def test_the_loop_stops_at_the_backends_end_of_generation_tokens():
    """LM.eog_ids (llama.cpp: llama_vocab_is_eog) end a generation like EOS, whatever the method."""
    tok = byte_tokenizer()
    lm = CachedLM(tiny_model(0))
    full = Engine(lm, tok).generate("abc", method="autoregressive", max_new_tokens=30).token_ids
    end = full[9]
    lm.eog_ids = frozenset({end})
    engine = Engine(lm, tok)
    for method in ("autoregressive", "pld"):
        out = engine.generate("abc", method=method, max_new_tokens=30)
        assert out.token_ids == full[: full.index(end) + 1] and out.stats.finish_reason == "eos"


def test_a_tree_of_fixed_width_and_depth_is_cut_to_a_bounded_pass():
    """A fixed width and depth grow up to width**2 nodes per depth (all verified when sampling): passes hold at
    most FIXED_TREE_NODES of them."""
    from specdecode.builders import FIXED_TREE_NODES

    tok = byte_tokenizer()
    engine = Engine(tiny_model(0), tok, tiny_model(1), tok)
    sizes, forward = [], engine.target.forward
    engine.target.forward = lambda ids, *a, **kw: sizes.append(len(ids)) or forward(ids, *a, **kw)
    out = engine.generate("abc", method="tree", tree_width=16, tree_depth=8, temperature=1.0, seed=0, max_new_tokens=10)
    assert out.stats.tree["nodes"] == FIXED_TREE_NODES and out.stats.new_tokens > 0
    assert max(sizes[1:]) <= FIXED_TREE_NODES + 1, max(sizes)  # the tree and its root (sizes[0]: the prompt)
