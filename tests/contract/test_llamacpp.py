"""The llama.cpp backend (llamacpp.LlamaLM) on tiny random F32 GGUF models (tinygguf.py), through the
real code paths: both loaders, long chains, sequence ids that refused passes give back, the engine (greedy
equality and a sampled distribution test with a negative control), and bad input. Tree passes and the KV
rollback invariant, the LM contract both backends keep, are in test_lm_contract.py (run there on llama.cpp's
default and exact contexts too).

Numerics. llama.cpp's default CPU context keeps keys and values in F16 and runs flash attention, which
accumulates in reduced precision in the order cells sit in the KV buffer. So, on these models:
- llama.cpp and transformers (fp32) differ by up to ~2.6e-3;
- a tree pass equals its path run as a chain bit for bit when the chain runs in a pass of the same
  number of tokens (llama.cpp picks kernels by batch size; against a fresh prefill: ~1e-6);
- logits depend on how the text was split into passes (one 300-token pass vs 299 + 1: up to ~3.5e-3
  once the context reaches ~64 tokens, chains alone) and, after branch rollbacks, on the order of the
  kept cells in the buffer: the rollback invariant holds to ~3.5e-3 on the default context.
  The same tests on a context with F32 keys/values and flash attention off (`exact_lm`: only llama.cpp's
  context parameters differ) agree to ~1.4e-6 and with transformers to ~2.4e-6, which shows the cache
  holds exactly the right entries. The LM-level tests run on both contexts (tinygguf.exact_lm).
- greedy speculative output may therefore leave plain decoding's only where the target's top-2 logits
  tie (within TIE, or TIE_EXACT on the exact context); the engine tests check exactly that.

Every model runs on ONE thread (THREADS): llama.cpp's workers spin-wait, and on a busy 2-core machine
a 1-token pass of these models took 260 ms with 2 threads against 0.15 ms with one.
"""

from __future__ import annotations

import os
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp", reason="the llama.cpp backend needs llama-cpp-python (not installed)")

import specdecode.verify as verify_mod  # noqa: E402  (verify.verdict calls verify, verify_tree from here)
import tinygguf  # noqa: E402
from helpers import CHEAP, EXPENSIVE, accept_everything, gof_pvalue, no_residual_update, residual_is_p, run_child  # noqa: E402
from specdecode import Engine, SamplingParams, SpecDecodeError  # noqa: E402
from specdecode.backends import (  # noqa: E402
    CachedLM,
    cache_dir,
    load_lm,
    resolve_backend,
)
from specdecode.backends.llamacpp import LlamaLM  # noqa: E402
from specdecode.cli import main  # noqa: E402
from specdecode.sampling import probs_from_logits  # noqa: E402
from tiny import byte_tokenizer, tiny_model  # noqa: E402
from tinygguf import write_tiny_gguf  # noqa: E402

THREADS = 1
V = 257
EOS = 256
PROMPT = [5, 17, 42, 99, 3, 8, 250]  # 7 tokens
ROOT = 61

# Tolerances (max abs logit difference; logits of these models are of size ~5; measured values in brackets)
LOADERS_TOL = 4e-3  # llama.cpp vs transformers fp32, every position of every prompt: default context [2.6e-3]
LOADERS_TOL_EXACT = 1e-5  # ... and on the exact context (F32 KV, no flash attention) [2.4e-6]
CHAIN_TOL = 1e-5  # a tree node vs a fresh prefill of its path [9.5e-7]
# after rollbacks, against a fresh prefill: default context [2.5e-3 here; 3.5e-3 seen for plain chains],
# F32 KV without flash attention [1.4e-6]
ROLLBACK_TOL = {"default": 6e-3, "exact": 1e-5}
# greedy outputs may differ only at ties of the top-2 logits within (two paths, each up to ~3.5e-3 off):
TIE = 1e-2  # on the default context [no divergence seen in 82 checks; emitted tokens <= 1.6e-3 below the argmax]
TIE_EXACT = 1e-4  # on the exact context


# ============================================================= models and fixtures

NEAR_NOISE = 0.05  # lm_head noise of the "near" draft (the tiny lm_head weights are ~0.16 in size)


def write_near_gguf(path):
    """The target (seed 0) with Gaussian noise on its output layer: a draft that agrees with the target on
    most greedy tokens and on about 55-90% of the sampled mass, so that drafted tokens are accepted and
    rejected (the seed-1 draft's top tokens never overlap the target's: it accepts nothing)."""

    def noisy(seed, **kw):
        model = tiny_model(seed, **kw)
        with torch.no_grad():
            g = torch.Generator().manual_seed(1234)
            model.lm_head.weight.add_(NEAR_NOISE * torch.randn(model.lm_head.weight.shape, generator=g))
        return model

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tinygguf, "tiny_model", noisy)
        return tinygguf.write_tiny_gguf(path, 0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    return SimpleNamespace(
        target=write_tiny_gguf(d / "target.gguf", 0),
        draft=write_tiny_gguf(d / "draft.gguf", 1),
        same=write_tiny_gguf(d / "same.gguf", 0),  # the target's weights in another file
        near=write_near_gguf(d / "near.gguf"),
        wide=write_tiny_gguf(d / "wide.gguf", 0, vocab_extra=5),  # 262 tokens
        short=write_tiny_gguf(d / "short.gguf", 0, ctx=256),  # a 256-token context
        long=write_tiny_gguf(d / "long.gguf", 0, ctx=1024),
    )


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    """Module fixtures run before conftest's per-test SPECDECODE_CACHE is set: give them their own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


def exact_lm(path) -> LlamaLM:
    return tinygguf.exact_lm(path, threads=THREADS)


@pytest.fixture(scope="module")
def lms(files):
    """{config: (lm under test, reference for fresh prefills)} for the default and the exact context."""
    return {
        "default": (LlamaLM(files.target, threads=THREADS), LlamaLM(files.target, threads=THREADS)),
        "exact": (exact_lm(files.target), exact_lm(files.target)),
    }


def fresh(ref: LlamaLM, ids: list[int]) -> torch.Tensor:
    """Last-position logits of a fresh prefill of ids (reset: an empty cache)."""
    ref.reset()
    return ref.forward(list(ids), last_only=True)[-1]


def assert_close(got, want, tol, what=""):
    diff = (got - want).abs().max().item()
    assert diff <= tol, f"{what}: max |logit difference| {diff:.3g} > {tol:.3g}"
    return diff


def load_engine(target, draft=None, **kw) -> Engine:
    return Engine.load(
        str(target), None if draft is None else str(draft), backend="llama.cpp", progress=False, threads=THREADS, **kw
    )


# ============================================================= 1. both loaders


def test_a_llama_model_puts_torch_on_one_thread_until_a_torch_model_comes(files, monkeypatch):
    """torch's libgomp runs llama.cpp's passes too, and every thread running a parallel torch op keeps a pool that
    makes llama.cpp's barriers sleep (serve: 11.0 -> 15.3 tok/s with torch on one thread): loading a llama.cpp
    model sets torch to 1 thread; a torch model loaded later gets the process's threads back."""
    import specdecode.backends.loading as loading

    before = torch.get_num_threads()
    monkeypatch.setattr(loading, "_torch_models", False)
    monkeypatch.setattr(loading, "_lowered_from", None)
    try:
        torch.set_num_threads(2)
        load_lm(str(files.target), "llama.cpp", threads=THREADS)
        assert torch.get_num_threads() == 1
        load_lm(str(files.target), "torch", dtype="fp32", device="cpu", progress=False)
        assert torch.get_num_threads() == 2
        load_lm(str(files.target), "llama.cpp", threads=THREADS)  # a torch model is loaded: left alone
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


LOADER_PROMPTS = ["hello world", "def quicksort(arr):\n    return", "日本語のテキスト", "x"]


def test_both_loaders_agree(files):
    lm, tok, backend = load_lm(str(files.target), "llama.cpp", threads=THREADS)
    hf, hf_tok, hf_backend = load_lm(str(files.target), "torch", dtype="fp32", device="cpu", progress=False)
    assert (backend, hf_backend) == ("llama.cpp", "torch")
    assert isinstance(lm, LlamaLM) and lm.backend == "llama.cpp" and lm.dtype == "F32"
    assert lm.vocab_size == V == hf.get_output_embeddings().weight.shape[0]
    assert lm.max_length == 512 and lm.eos_token_ids == {EOS}
    # one tokenizer, read from the same file by both loaders, equal to the one the file was written from
    assert tok.get_vocab() == hf_tok.get_vocab() == byte_tokenizer().get_vocab()
    messages = [{"role": "user", "content": "hi"}]
    assert (
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        == hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        == "<user>hi\n<assistant>"
    )
    reference = tiny_model(0)
    exact = exact_lm(files.target)
    worst = 0.0
    for prompt in LOADER_PROMPTS:
        ids = tok(prompt)["input_ids"]
        assert ids == hf_tok(prompt)["input_ids"] and len(ids) == len(prompt.encode())
        assert tok.decode(ids) == hf_tok.decode(ids) == prompt
        lm.reset()
        got = lm.forward(ids)  # every position, not only the next token
        want = CachedLM(hf).forward(ids)
        assert got.shape == want.shape == (len(ids), V) and got.dtype == torch.float32
        worst = max(worst, assert_close(got, want, LOADERS_TOL, repr(prompt)))
        exact.reset()
        assert_close(exact.forward(ids), want, LOADERS_TOL_EXACT, f"{prompt!r} on the exact context")
        # the torch loader dequantizes exactly the weights the file was written from
        assert_close(want, CachedLM(reference).forward(ids), 1e-5, "torch loader vs tiny_model(0)")
        lm.reset()
        assert_close(lm.forward(ids, last_only=True)[0], got[-1], CHAIN_TOL, "last_only")
    assert worst > 0  # (two different implementations: a zero would mean one compared with itself)


def test_backend_resolution(files, tiny_dirs):
    assert resolve_backend("auto", str(files.target), "cpu") == "llama.cpp"
    assert resolve_backend("auto", str(tiny_dirs[0]), "cpu") == "torch"
    assert resolve_backend("llama.cpp", str(files.target), "cpu") == "llama.cpp"
    with pytest.raises(SpecDecodeError, match="GGUF"):
        resolve_backend("llama.cpp", str(tiny_dirs[0]), "cpu")


# ============================================================= 2. long chains and sequence ids


@pytest.mark.parametrize("config", ["default", "exact"])
def test_chain_longer_than_a_batch(files, config):
    """A causal feed longer than llama.cpp's batch (512 tokens) is split into several decodes; last_only
    keeps one row; a feed past the cache is refused and changes nothing."""
    make = exact_lm if config == "exact" else (lambda path: LlamaLM(path, threads=THREADS))
    lm, ref, tol = make(files.long), make(files.long), ROLLBACK_TOL[config]
    assert lm.max_length == 1024
    ids = [(7 * i + 3) % 256 for i in range(700)]
    logits = lm.forward(ids)
    assert logits.shape == (700, V) and len(lm) == 700
    ref.forward(ids[:350])
    halves = torch.cat([ref.forward(ids[350:600]), ref.forward(ids[600:])])
    assert_close(logits[350:], halves, tol, "700 tokens at once vs 350 + 250 + 100")
    ref.reset()
    assert_close(ref.forward(ids, last_only=True)[0], logits[-1], tol, "last_only")
    with pytest.raises(SpecDecodeError, match="context"):
        lm.forward([1] * 4000)  # far past the cache
    assert len(lm) == 700
    lm.rollback(300)
    assert_close(lm.forward([77])[-1], fresh(ref, ids[:300] + [77]), tol, "after rollback(300)")


def test_refused_tree_passes_leak_no_sequence_ids(lms):
    """A tree pass refused for a bad parent must leave the cache as it was, sequence ids included: nodes
    fed before the bad one must not keep the ids they took. After 300 refused passes, every one refused
    for its own reason, a pass of 255 sibling nodes (every id) still works."""
    lm, ref = lms["default"]
    lm.reset()
    lm.forward(PROMPT)
    n = len(lm)
    for i in range(300):
        with pytest.raises(ValueError) as refused:
            lm.forward([ROOT, 11, 12, 13], parents=[n - 1, n, n, 1])  # token 3 hangs inside the committed text
        assert "inside the committed text" in str(refused.value), f"refused pass {i}: {refused.value}"
    assert lm.ids == PROMPT
    logits = lm.forward([90] * 255, parents=[n - 1] * 255)
    assert_close(logits[254], fresh(ref, PROMPT + [90]), ROLLBACK_TOL["default"], "after refused passes")


# ============================================================= 3. the engine, greedy

GREEDY_PROMPTS = ["hello world", "def quicksort(arr):\n", "abcabcabcabc", "x"]  # "x" ends at EOS (76 tokens)
N_GREEDY = 200


@pytest.fixture(scope="module")
def engine(files, module_cache):
    """The pair: target seed 0, draft seed 1 (in the type --draft-quant auto picks). The seed-1 draft's
    guesses are never the target's: its chains are always rejected at once."""
    return load_engine(files.target, files.draft)


@pytest.fixture(scope="module")
def near_engine(files, module_cache):
    """Target seed 0, draft = the target with a noisy output layer (kept F32): partial acceptance."""
    return load_engine(files.target, files.near, draft_quant="none")


@pytest.fixture(scope="module")
def exact_engine(files, module_cache):
    """The near pair on contexts with F32 keys/values and no flash attention (Engine wraps loaded LMs)."""
    from specdecode.backends import gguf_tokenizer

    tok = gguf_tokenizer(files.target, progress=False)
    return Engine(exact_lm(files.target), tok, exact_lm(files.near), gguf_tokenizer(files.near, progress=False))


@pytest.fixture(scope="module")
def greedy(engine, near_engine, exact_engine, files):
    """name -> (engine, reference LM for fresh prefills, tie bound, plain decoding's output by prompt)."""
    cases = {}
    for name, eng, ref, tie in (
        ("seed1", engine, LlamaLM(files.target, threads=THREADS), TIE),
        ("near", near_engine, LlamaLM(files.target, threads=THREADS), TIE),
        ("exact", exact_engine, exact_lm(files.target), TIE_EXACT),
    ):
        memo = {}

        def plain(prompt, eng=eng, memo=memo):
            if prompt not in memo:
                memo[prompt] = eng.generate(prompt, method="autoregressive", max_new_tokens=N_GREEDY).token_ids
            return memo[prompt]

        cases[name] = SimpleNamespace(engine=eng, ref=ref, tie=tie, plain=plain)
    return cases


@pytest.fixture(scope="module")
def target_ref(files):
    return LlamaLM(files.target, threads=THREADS)


def check_greedy(case, prompt, got, what):
    """got must equal plain decoding's output; where it does not, the first divergence must be at a tie of
    the target's top-2 logits (fresh prefill) within the case's tie bound, between exactly those two
    tokens. Either way every token of got must be an argmax of the text before it, up to that bound."""
    prompt_ids, want, ref, tie = case.engine.encode(prompt), case.plain(prompt), case.ref, case.tie
    ref.reset()
    rows = ref.forward(prompt_ids + got)[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(got)]
    slack = rows.max(-1).values - rows[torch.arange(len(got)), torch.tensor(got)]
    assert slack.max().item() <= tie, (
        f"{what}: token {int(slack.argmax())} is {slack.max().item():.3g} below the argmax"
    )
    if got == want:
        return 0
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert i < min(len(got), len(want)), f"{what}: {len(got)} tokens against plain decoding's {len(want)}"
    top = fresh(ref, prompt_ids + want[:i]).topk(2)
    margin = (top.values[0] - top.values[1]).item()
    assert set(top.indices.tolist()) == {got[i], want[i]} and margin <= tie, (
        f"{what}: diverges at token {i} ({got[i]} vs {want[i]}), where the top-2 margin is {margin:.3g}"
    )
    return 1


GREEDY_CASES = [
    ("draft", dict(gamma=1)),
    ("draft", dict(gamma=3)),
    ("draft", dict(gamma=6)),
    ("pld", dict(gamma=4)),
    ("tree", {}),
    ("tree", dict(tree_width=2, tree_depth=3)),
    ("tree", dict(tree_width=3, tree_depth=4, tree_nodes=6)),
    ("auto", {}),
]


@pytest.mark.parametrize("which", ["seed1", "near", "exact"])
@pytest.mark.parametrize(
    "method, kw",
    GREEDY_CASES,
    ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}{v}" for k, v in x.items()) or "cost-model",
)
def test_greedy_methods_equal_autoregressive(greedy, which, method, kw):
    case = greedy[which]
    eng = case.engine
    assert eng.backend == "llama.cpp" and isinstance(eng.target, LlamaLM) and isinstance(eng.draft_model.lm, LlamaLM)
    prompts = GREEDY_PROMPTS if which == "seed1" else GREEDY_PROMPTS[:2]
    accepted = rejections = 0
    for prompt in prompts:
        out = eng.generate(prompt, method=method, max_new_tokens=N_GREEDY, **kw)
        check_greedy(case, prompt, out.token_ids, f"{which}: {method} {kw} on {prompt!r}")
        s = out.stats
        assert s.new_tokens == len(out.token_ids) and s.accepted <= s.drafted
        assert s.finish_reason == ("eos" if out.token_ids[-1] == EOS else "length")
        accepted, rejections = accepted + s.accepted, rejections + s.rejections
    if method == "tree" or (which != "seed1" and method != "auto"):
        assert accepted > 0  # whole branches get accepted (lookup branches, and the near draft's guesses)
    if which != "seed1" and method == "draft":
        assert rejections > 0  # and rejected


def test_auto_with_given_costs_equals_autoregressive(greedy, monkeypatch):
    """The auto method on both sides of its draft-model gate: cheap passes (the draft model runs, in
    trees) and expensive ones (plain steps and prompt lookup only)."""
    for which, case in greedy.items():
        for costs in (CHEAP, EXPENSIVE):
            monkeypatch.setattr(case.engine, "costs", costs)
            for prompt in GREEDY_PROMPTS[:2]:
                out = case.engine.generate(prompt, method="auto", max_new_tokens=N_GREEDY)
                priced = "cheap" if costs is CHEAP else "expensive"
                check_greedy(case, prompt, out.token_ids, f"{which}: auto, {priced}")
                assert out.stats.tree == {"draft_model": costs is CHEAP}


def test_identical_draft_accepts_everything(files, module_cache, greedy):
    """A draft file with the target's weights (kept F32: draft_quant="none"; "auto" may requantize it)."""
    eng = load_engine(files.target, files.same, draft_quant="none")
    case = SimpleNamespace(**{**vars(greedy["seed1"]), "engine": eng})  # the same target, plain output and bound
    for prompt in GREEDY_PROMPTS[:2]:
        for gamma in (2, 5):
            out = eng.generate(prompt, method="draft", gamma=gamma, max_new_tokens=N_GREEDY)
            check_greedy(case, prompt, out.token_ids, f"draft gamma {gamma} on {prompt!r}")
            s = out.stats
            assert s.acceptance_rate == 1.0 and s.rejections == 0 and s.accepted == s.drafted > 0
            assert s.mean_accepted_tokens > gamma + 0.5
        out = eng.generate(prompt, method="tree", tree_width=1, tree_depth=4, max_new_tokens=N_GREEDY)
        check_greedy(case, prompt, out.token_ids, f"tree on {prompt!r}")
        d = out.stats.sources["draft"]  # the draft model's nodes (lookup guesses may join the tree too)
        assert d["accepted"] > 0.8 * d["drafted"]


def test_generation_stops_at_the_context_limit(files, module_cache):
    """A 256-token context: generation stops there (finish "length") with every method, and a prompt
    that fills the context is a clear error."""
    eng = load_engine(files.short, files.near, draft_quant="none")
    assert eng.target.max_length == 256
    prompt = "".join(chr(97 + (2 + 7 * i) % 26) for i in range(200))  # (other shifts hit EOS early)
    want = eng.generate(prompt, method="autoregressive", max_new_tokens=100)
    assert len(want.token_ids) == 56 and want.stats.finish_reason == "length"
    case = SimpleNamespace(
        engine=eng, ref=LlamaLM(files.short, threads=THREADS), tie=TIE, plain=lambda _: want.token_ids
    )
    for method, kw in (("draft", dict(gamma=4)), ("pld", {}), ("tree", dict(tree_width=2, tree_depth=5))):
        out = eng.generate(prompt, method=method, max_new_tokens=100, **kw)
        check_greedy(case, prompt, out.token_ids, method)
        assert len(out.token_ids) == 56 and out.stats.finish_reason == "length", method
    for method in ("autoregressive", "draft"):
        with pytest.raises(SpecDecodeError, match="context"):
            eng.generate("y" * 300, method=method, max_new_tokens=5)
        with pytest.raises(SpecDecodeError, match="context"):
            eng.generate("y" * 256, method=method, max_new_tokens=5)


# ============================================================= 4. the engine, sampled

SAMPLED = SamplingParams(temperature=1.0, top_k=4)
SAMPLED_PROMPT = "foo"  # beta = sum(min(p, q)) ~0.56 for the first token and ~0.58 for the second
ALPHA = 1e-6
# A generation through the engine costs ~3 ms (chain) and ~4.5 ms (tree) on a shared 2-core machine: 20k
# would take 60-90 s per method, so N is cut to keep each test under ~20 s. The negative controls need far
# fewer: at 300 runs their p-values were 0 (accept everything: tokens outside the target's top-4),
# 1e-17..1e-22 (residual replaced by p) and 1e-37..1e-40 (tree siblings without the residual update).
N_CHAIN, N_TREE, N_CONTROL = 5000, 4000, 300


def exact_pair_law(ref, prompt_ids):
    """P(x1, x2 | prompt) = p(x1 | prompt) p(x2 | prompt, x1), from fresh prefills, through the engine's
    own transform (temperature 1, top-4)."""
    p1 = probs_from_logits(fresh(ref, prompt_ids), SAMPLED).double()
    law = torch.zeros(V, V, dtype=torch.float64)
    for x in p1.nonzero().flatten().tolist():
        law[x] = p1[x] * probs_from_logits(fresh(ref, prompt_ids + [x]), SAMPLED).double()
    return law.numpy()


def sampled_pairs(eng, n, method, seed0=0, **kw):
    """Counts [V, V] of the first two tokens of n generations (max_new_tokens=3 lets the first pass draft
    two deep; the first two of three tokens have the target's joint law if the three do)."""
    counts = np.zeros((V, V))
    accepted = rejections = deep = 0
    for s in range(n):
        out = eng.generate(
            SAMPLED_PROMPT,
            method=method,
            max_new_tokens=3,
            temperature=SAMPLED.temperature,
            top_k=SAMPLED.top_k,
            seed=seed0 + s,
            **kw,
        )
        ids = out.token_ids
        assert len(ids) >= 2, ids  # (no EOS in the support: checked on the law)
        counts[ids[0], ids[1]] += 1
        st = out.stats
        accepted, rejections = accepted + st.accepted, rejections + st.rejections
        deep += len(st.drafted_per_position) >= 2
    return counts, SimpleNamespace(accepted=accepted, rejections=rejections, deep=deep)


@pytest.fixture(scope="module")
def law(near_engine, target_ref):
    law = exact_pair_law(target_ref, near_engine.encode(SAMPLED_PROMPT))
    assert abs(law.sum() - 1) < 1e-6 and law[EOS].sum() == law[:, EOS].sum() == 0  # (float32 probabilities)
    assert (law > 0).sum() == 16  # 4 first tokens x 4 second tokens
    return law


@pytest.mark.stat
def test_sampled_draft_chain_keeps_the_target_distribution(near_engine, law, monkeypatch):
    counts, st = sampled_pairs(near_engine, N_CHAIN, "draft", gamma=2)
    assert st.deep > 0.9 * N_CHAIN  # first passes draft two deep
    assert st.accepted > 0.3 * N_CHAIN and st.rejections > 0.3 * N_CHAIN  # both halves of the rule run
    p = gof_pvalue(counts, law)
    assert p > ALPHA, p
    p1 = gof_pvalue(counts.sum(1), law.sum(1))
    assert p1 > ALPHA, p1
    # negative controls: the same harness with a wrong verifier must fail
    for wrong in (accept_everything, residual_is_p):
        monkeypatch.setattr(verify_mod, "verify", wrong)
        bad, _ = sampled_pairs(near_engine, N_CONTROL, "draft", seed0=10**6, gamma=2)
        p_bad = gof_pvalue(bad, law)
        assert p_bad < ALPHA, (wrong.__name__, p_bad)


@pytest.mark.stat
def test_sampled_tree_keeps_the_target_distribution(near_engine, law, monkeypatch):
    kw = dict(tree_width=2, tree_depth=2, tree_nodes=8)
    counts, st = sampled_pairs(near_engine, N_TREE, "tree", **kw)
    assert st.deep > 0.9 * N_TREE
    assert st.accepted > 0.3 * N_TREE and st.rejections > 0.1 * N_TREE
    p = gof_pvalue(counts, law)
    assert p > ALPHA, p
    p1 = gof_pvalue(counts.sum(1), law.sum(1))
    assert p1 > ALPHA, p1
    # negative control: siblings tried against p itself, never the residual (test_verify_tree's control)
    monkeypatch.setattr(verify_mod, "verify_tree", no_residual_update("p"))
    bad, _ = sampled_pairs(near_engine, N_CONTROL, "tree", seed0=10**6, **kw)
    p_bad = gof_pvalue(bad, law)
    assert p_bad < ALPHA, p_bad


# ============================================================= 5. bad input


def leftovers(root):
    """Temporary or half-written entries under the cache dir (names the writers give them)."""
    bad = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            if name.startswith(".") or ".tmp" in name or "extracting" in name or "quantizing" in name:
                bad.append(os.path.join(dirpath, name))
    return bad


def corrupt_files(files, tmp_path):
    good = files.target.read_bytes()
    made = {
        "garbage": os.urandom(4096),
        "gguf-magic-then-garbage": b"GGUF" + os.urandom(4096),
        "truncated-half": good[: len(good) // 2],
        "truncated-header": good[:3000],
        "empty": b"",
    }
    paths = {}
    for name, data in made.items():
        paths[name] = tmp_path / f"{name}.gguf"
        paths[name].write_bytes(data)
    return paths


def test_missing_and_corrupt_gguf_are_clear_errors(files, tmp_path):
    missing = tmp_path / "missing.gguf"
    with pytest.raises(SpecDecodeError, match="not found"):
        load_lm(str(missing), "llama.cpp", threads=THREADS)
    with pytest.raises(SpecDecodeError, match="not found"):
        LlamaLM(missing)
    with pytest.raises(SpecDecodeError, match="not found"):
        load_engine(missing)
    for name, path in corrupt_files(files, tmp_path).items():
        with pytest.raises(SpecDecodeError, match="GGUF") as e:
            load_lm(str(path), "llama.cpp", threads=THREADS)
        assert str(path) in str(e.value), name
        with pytest.raises(SpecDecodeError, match="could not load"):
            LlamaLM(path, threads=THREADS)  # llama.cpp itself refuses it too (no crash)
        with pytest.raises(SpecDecodeError):
            load_engine(files.target, path)  # a corrupt draft
    assert leftovers(cache_dir()) == []
    tokenizers = cache_dir() / "tokenizers"
    assert not tokenizers.exists() or len(list(tokenizers.iterdir())) == 1  # the good target's only


def test_cli_exit_2_with_one_line(files, tiny_dirs, tmp_path, capsys):
    bad = corrupt_files(files, tmp_path)["gguf-magic-then-garbage"]
    for target, match in ((bad, "GGUF"), (tmp_path / "missing.gguf", "not found"), (tiny_dirs[0], "GGUF")):
        code = main(
            [
                "generate",
                "hello",
                "--target",
                str(target),
                "--backend",
                "llama.cpp",
                "--threads",
                "1",
                "--max-new-tokens",
                "4",
            ]
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("specdecode: error:") and match in err[0], err
    # (--json: no progress bar for choosing the draft's quantization, which runs before the vocabulary check)
    code = main(
        [
            "generate",
            "hello",
            "--target",
            str(files.target),
            "--draft",
            str(files.wide),
            "--backend",
            "llama.cpp",
            "--threads",
            "1",
            "--method",
            "draft",
            "--max-new-tokens",
            "4",
            "--json",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "vocabulary" in err[0], err
    assert leftovers(cache_dir()) == []


def test_cli_generates_on_llama_cpp(files, greedy, capsys):
    import json

    code = main(
        [
            "generate",
            "hello world",
            "--target",
            str(files.target),
            "--draft",
            str(files.draft),
            "--backend",
            "llama.cpp",
            "--threads",
            "1",
            "--method",
            "draft",
            "--gamma",
            "3",
            "--max-new-tokens",
            "40",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == greedy["seed1"].plain("hello world")[:40]


def test_draft_with_another_vocabulary(files):
    with pytest.raises(SpecDecodeError, match="vocabulary"):
        load_engine(files.target, files.wide)
    with pytest.raises(SpecDecodeError, match="vocabulary"):
        load_engine(files.target, files.wide, draft_quant="none")
    assert leftovers(cache_dir()) == []


def test_prompt_longer_than_the_context(files):
    lm = LlamaLM(files.short, threads=THREADS)
    assert lm.max_length == 256
    lm.forward(list(range(250)))
    with pytest.raises(SpecDecodeError, match="context"):
        lm.forward([1] * 4000)
    with pytest.raises(SpecDecodeError, match="context"):
        lm.forward([1] * 4000, parents=[249] * 4000)
    assert len(lm) == 250
    eng = load_engine(files.short)
    with pytest.raises(SpecDecodeError, match="context"):
        eng.generate("z" * 400, method="pld", max_new_tokens=3)
    assert leftovers(cache_dir()) == []


@pytest.mark.process
def test_small_context_gguf_is_not_a_crash(files, tmp_path):
    """A GGUF whose context is below 256 tokens must load (or fail with SpecDecodeError), never abort the
    process. Run in a child process: llama.cpp aborts with GGML_ASSERT(n_outputs_max <= ...) here."""
    small = write_tiny_gguf(tmp_path / "ctx128.gguf", 0, ctx=128)
    script = textwrap.dedent(f"""
        from specdecode.errors import SpecDecodeError
        from specdecode.backends.llamacpp import LlamaLM
        try:
            lm = LlamaLM({str(small)!r}, threads=1)
            print("loaded", lm.max_length, lm.forward([1, 2, 3]).shape[0])
        except SpecDecodeError as e:
            print("error", e)
        """)
    r = run_child([sys.executable, "-c", script], timeout=120, env={"SPECDECODE_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0 and r.stdout.startswith(("loaded", "error")), (
        f"exit status {r.returncode}: {r.stderr.strip().splitlines()[-1:] if r.stderr.strip() else r.stdout}"
    )


def test_end_of_generation_tokens_are_llama_cpps_own_list(tmp_path):
    """llama.cpp names every token that ends a generation (llama_vocab_is_eog): more than EOS and EOT."""
    special = ("<|im_end|>", "<|eom_id|>", "<end_of_turn>")
    lm = LlamaLM(write_tiny_gguf(tmp_path / "eog.gguf", 0, special=special), threads=1)
    ids = {257 + i for i in range(len(special))}
    assert ids | {256} <= lm.eog_ids and ids - lm.eos_token_ids  # some are neither EOS nor EOT
    assert ids <= Engine(lm, byte_tokenizer()).eos_ids  # what the loop stops on


def test_tree_shapes_are_checked_against_the_cache_before_the_request_starts(files):
    """llama.cpp holds 255 tree nodes: a bigger tree is refused when the stream opens, naming the parameter, and
    a tree of fixed width and depth (up to width**2 nodes per depth) is cut to what the cache holds."""
    tok = byte_tokenizer()
    engine = Engine(LlamaLM(files.target, threads=1), tok, LlamaLM(files.draft, threads=1), tok)
    engine.progress = False
    with pytest.raises(SpecDecodeError, match="tree_nodes must be at most 255"):
        engine.stream("abc", method="tree", tree_nodes=300)
    with pytest.raises(SpecDecodeError, match="tree_width x tree_depth must be at most 255"):
        engine.stream("abc", method="tree", tree_width=64, tree_depth=8)
    out = engine.generate(
        "abc", method="tree", tree_width=16, tree_depth=4, temperature=1.0, seed=0, max_new_tokens=12
    )  # sampled: every drawn node is verified, 16 + 3 x 256 of them uncut
    assert out.stats.tree["nodes"] == 255 and out.stats.new_tokens > 0


def _claims_amx(monkeypatch, probe: str):
    """A build that reports AMX_INT8 (as a native build on a CPU with AMX does), a file with weights of a type
    AMX takes, and the child's check replaced by `probe` (plain Python: no model is loaded)."""
    import specdecode.backends.llamacpp.amx as L

    monkeypatch.setattr(L, "_system_info", lambda lc: b"CPU : AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 |")
    monkeypatch.setattr(L, "_amx_weight_types", lambda path: {"Q4_K"})
    monkeypatch.setattr(L, "AMX_PROBE", probe)
    monkeypatch.setattr(L, "_amx_usable", {})
    return L


def test_amx_check_leaves_a_corrupt_file_to_llama_cpps_clear_error(files, tmp_path, monkeypatch):
    """On a build with AMX kernels the check reads the file's tensor types first: a file that is not a GGUF must
    still end in llama.cpp's clear error, not in the gguf reader's ValueError."""
    import specdecode.backends.llamacpp.amx as L

    monkeypatch.setattr(L, "_system_info", lambda lc: b"CPU : AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 |")
    monkeypatch.setattr(L, "_amx_usable", {})
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file " * 64)
    assert L._amx_weight_types(bad) == set()
    with pytest.raises(SpecDecodeError, match="could not load"):
        LlamaLM(bad, threads=THREADS)


def test_amx_kernels_that_crash_turn_the_extra_buffers_off(files, monkeypatch, capfd):
    """GCC 12 builds of llama.cpp's AMX kernels die of a general protection fault on the first batched matmul:
    a child that dies of a signal marks the build unusable for that file, the model loads without extra
    (repacked, AMX) buffers, the user is told how to rebuild, and the verdict is cached (no second child)."""
    L = _claims_amx(monkeypatch, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    lm = LlamaLM(files.target, threads=THREADS)
    assert lm.repack is False
    assert "-mno-amx-int8" in capfd.readouterr().err
    lm.forward([1, 2, 3])
    monkeypatch.setattr(L, "_amx_usable", {})  # a new process: the cached record answers, and the user is told again
    monkeypatch.setattr(L.subprocess, "run", lambda *a, **k: pytest.fail("the verdict was not cached"))
    assert L.amx_usable(files.target, llama_cpp) is False
    assert "-mno-amx-int8" in capfd.readouterr().err


def test_amx_kernels_that_run_keep_the_repacked_weights(files, monkeypatch):
    """The negative control: a child that passes leaves repacking on; a build without AMX_INT8 starts no child."""
    L = _claims_amx(monkeypatch, "pass")
    assert LlamaLM(files.target, threads=THREADS).repack is True
    monkeypatch.setattr(L, "_amx_usable", {})
    monkeypatch.setattr(L, "_system_info", lambda lc: b"CPU : AVX2 = 1 | REPACK = 1 |")
    monkeypatch.setattr(L.subprocess, "run", lambda *a, **k: pytest.fail("a child for a build without AMX"))
    assert L.amx_usable(files.draft, llama_cpp) is True
