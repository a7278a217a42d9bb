"""Exact greedy mode (exactness.py, Engine(exact=True), --exact): every logits row the verifier reads is
bit-identical to plain decoding's, on llama.cpp's quantized kernels (tiny GGUFs requantized to Q4_0, Q8_0 and
Q4_K_M, so the repacked and K-quant paths run) and on torch; our plain decoding equals llama-cpp-python's own
greedy generation; and the negative controls: passes past the measured sizes, and trees without parked
cells, do change bits, so the comparison can see what exact mode prevents."""

from __future__ import annotations

import ctypes
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specdecode import Engine, SpecDecodeError, exactness
from specdecode.backends.torch_lm import CachedLM
from specdecode.certify import _recorded, check_greedy
from specdecode.drafters import Draft
from tiny import byte_tokenizer, tiny_model

METHODS = ["draft", "pld", "tree", "auto", "lookup"]
PROMPTS = ["abcabcabcabc abcabc", "the cat sat on the mat; the cat sat on the"]
TYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15}
NEW = 40


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """Tiny GGUFs (hidden 256: K-quant blocks fit) in F32 and requantized."""
    pytest.importorskip("llama_cpp")
    from specdecode.backends.llamacpp.lm import _lib
    from tinygguf import write_tiny_gguf

    lc = _lib()
    d = tmp_path_factory.mktemp("exact")
    src = write_tiny_gguf(d / "tiny-F32.gguf", 0, hidden=256)
    out = {"F32": src}
    for name, ftype in TYPES.items():
        p = lc.llama_model_quantize_default_params()
        p.ftype, p.nthread = ftype, 1
        dst = d / f"tiny-{name}.gguf"
        assert lc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) == 0
        out[name] = dst
    return out


def engine_on(path: Path, exact: bool = True) -> Engine:
    """Target loaded for exact mode; the draft is the same file on a default context (high acceptance, so
    passes of every allowed size run)."""
    from specdecode.backends.llamacpp import LlamaLM

    tok = byte_tokenizer()
    return Engine(LlamaLM(path, threads=1, exact=exact), tok, LlamaLM(path, threads=1), tok, exact=exact)


@pytest.mark.parametrize("qtype", list(TYPES))
def test_every_method_reads_plain_decodings_bits(ggufs, qtype):
    engine = engine_on(ggufs[qtype])
    limits = exactness.limits(engine.target)
    assert 1 <= limits.max_pass <= exactness.MAX_SIZE
    longest = 0
    for prompt in PROMPTS:
        plain, rows = _recorded(engine, prompt, "autoregressive", NEW)
        for m in METHODS:
            r = check_greedy(engine, prompt, m, NEW, plain.token_ids, rows)
            assert r["identical"] and r["passed"], (qtype, m, r)
            assert r["bit_identical"] == r["positions_compared"] == len(plain.token_ids), (qtype, m, r)
        longest = max(longest, engine.generate(prompt, method="draft", gamma=8, max_new_tokens=NEW).stats.accepted)
    assert longest > 0  # guesses were accepted: passes of several tokens ran


def test_negative_control_passes_past_the_measured_size_change_bits(ggufs, monkeypatch):
    """Q4_K_M: a pass longer than the measured size takes another kernel (repacked groups of 4 on x86);
    allowing 16-token passes must show up as rows that are not bit-identical."""
    engine = engine_on(ggufs["Q4_K_M"])
    limits = exactness.limits(engine.target)
    if limits.max_pass >= exactness.MAX_SIZE:
        pytest.skip(f"every pass up to {exactness.MAX_SIZE} tokens is exact on this machine: nothing to control")
    monkeypatch.setattr(engine, "_exact_limits", exactness.ExactLimits(16, True, max_context=10**6))
    differs = 0
    for prompt in PROMPTS:
        plain, rows = _recorded(engine, prompt, "autoregressive", NEW)
        r = check_greedy(engine, prompt, "draft", NEW, plain.token_ids, rows)
        differs += r["positions_compared"] - r["bit_identical"]
        assert not r["passed"]  # exact mode: any differing bit fails the check
    assert differs > 0


def test_parked_cells_keep_trees_exact_and_their_control(ggufs):
    """After a tree pass whose accepted branch leaves a rejected node below it, later logits equal plain
    decoding's only if that node's cell stays occupied (parked): without parking, later text fills the
    hole and attention sums the cells in another order."""
    from specdecode.backends.llamacpp import LlamaLM

    lm = LlamaLM(ggufs["Q4_K_M"], threads=1, exact=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (48,), generator=g).tolist()
    ids, ref = exactness._plain(lm, prompt, 16)
    assert torch.equal(exactness._tree_rounds(lm, prompt, ids, 3), ref)
    lm.exact = False  # the same context (flash attention on), parking off
    assert not torch.equal(exactness._tree_rounds(lm, prompt, ids, 3), ref)


def _peer_greedy(peer, ids: list[int], n: int, eos: set[int]) -> list[int]:
    """llama-cpp-python's own greedy generation: up to n tokens, or to an end-of-generation token."""
    theirs = []
    for t in peer.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        theirs.append(t)
        if len(theirs) == n or t in eos:
            break
    return theirs


def test_plain_decoding_equals_llama_cpp_pythons_own(ggufs):
    from llama_cpp import Llama

    from specdecode.backends.llamacpp import LlamaLM

    path = ggufs["Q4_K_M"]
    engine = Engine(LlamaLM(path, threads=1, exact=True), byte_tokenizer(), exact=True)
    peer = Llama(str(path), n_ctx=512, n_threads=1, n_threads_batch=1, n_batch=512, flash_attn=True, verbose=False)
    for prompt in PROMPTS:
        ours = engine.generate(prompt, method="autoregressive", max_new_tokens=NEW).token_ids
        ids = engine.encode(prompt)
        assert ours == _peer_greedy(peer, ids, len(ours), engine.eos_ids)


@pytest.mark.parametrize("qtype", list(TYPES))
def test_default_greedy_reads_the_prompt_as_llama_cpp_python_does(ggufs, qtype):
    """Outside exact mode too, greedy decoding reads the whole prompt in its own passes and takes the first token
    from its last row, as llama-cpp-python's generation does (before: the prompt but its last token, which went
    into the first 1-token pass: its keys and values rounded as a 1-row pass, and greedy output left the peer's
    on 10 of 10 MT-bench questions on a Zen 4); our plain decoding then equals the peer's (flash attention off,
    llama-cpp-python's default) token for token."""
    from llama_cpp import Llama

    from specdecode.backends.llamacpp import LlamaLM

    lm = LlamaLM(ggufs[qtype], threads=1)
    engine = Engine(lm, byte_tokenizer())
    peer = Llama(str(ggufs[qtype]), n_ctx=512, n_threads=1, n_threads_batch=1, n_batch=512, verbose=False)
    sizes, forward = [], lm.forward
    lm.forward = lambda ids, *a, **k: sizes.append(len(ids)) or forward(ids, *a, **k)
    for prompt in PROMPTS:
        del sizes[:]
        ours = engine.generate(prompt, method="autoregressive", max_new_tokens=NEW).token_ids
        ids = engine.encode(prompt)
        assert sizes[0] == len(ids) and set(sizes[1:]) == {1}, sizes
        assert ours == _peer_greedy(peer, ids, len(ours), engine.eos_ids)
    sampled = engine.generate(PROMPTS[0], method="autoregressive", max_new_tokens=4, temperature=1.0, seed=0)
    assert len(sampled.token_ids) == 4  # sampled decoding keeps the last prompt token for the first pass


def test_torch_exact_mode_is_bit_identical():
    tok = byte_tokenizer()
    engine = Engine(tiny_model(0), tok, tiny_model(0), tok, exact=True)
    limits = exactness.limits(engine.target)
    assert limits.max_pass >= 1
    for prompt in PROMPTS:
        plain, rows = _recorded(engine, prompt, "autoregressive", NEW)
        for m in METHODS:
            r = check_greedy(engine, prompt, m, NEW, plain.token_ids, rows)
            assert r["identical"] and r["bit_identical"] == r["positions_compared"], (m, r)


def test_exact_mode_errors(ggufs):
    from specdecode.backends.llamacpp import LlamaLM

    tok = byte_tokenizer()
    engine = Engine(LlamaLM(ggufs["Q4_0"], threads=1), tok)
    with pytest.raises(SpecDecodeError, match="exact mode needs a target loaded for it"):
        engine.generate("abc", method="autoregressive", exact=True, max_new_tokens=4)
    exact = Engine(LlamaLM(ggufs["Q4_0"], threads=1, exact=True), tok, exact=True)
    with pytest.raises(SpecDecodeError, match="exact mode is for greedy decoding"):
        exact.generate("abc", method="autoregressive", exact=True, temperature=0.7, max_new_tokens=4)
    # the Engine's default applies to greedy requests; a sampled one runs as usual
    assert exact.generate("abc", method="pld", temperature=0.7, seed=1, max_new_tokens=4).token_ids
    with pytest.raises(SpecDecodeError, match="exclude each other"):
        LlamaLM(ggufs["Q4_0"], exact=True, f32_kv=True)


def test_limits_are_cached_per_model(ggufs, monkeypatch):
    from specdecode.backends.llamacpp import LlamaLM

    lm = LlamaLM(ggufs["Q8_0"], threads=1, exact=True)
    first = exactness.limits(lm)
    monkeypatch.setattr(exactness, "measure", lambda lm: pytest.fail("measured twice"))
    assert exactness.limits(lm) == first


def test_draft_prefix():
    chain = Draft([5, 6, 7], None)
    assert chain.prefix(2).tokens == [5, 6] and chain.prefix(2).parents is None
    assert chain.prefix(5) is chain
    q = torch.eye(4)[:3]
    tree = Draft([1, 2, 3, 4][:3], q, parents=[-1, -1, 0], sources=["a", "b", "c"])
    cut = tree.prefix(2)
    assert cut.tokens == [1, 2] and cut.parents == [-1, -1] and cut.q.shape[0] == 2 and cut.sources == ["a", "b"]
    assert tree.prefix(3, chain=True).tokens == [1] and tree.prefix(3, chain=True).parents is None
    deep = Draft([1, 2, 3], None, parents=[-1, 0, 1])
    assert deep.prefix(9, chain=True).tokens == [1, 2, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_transformers_generate(dtype, monkeypatch):
    """An independent reference for every greedy guarantee on torch: transformers' own `generate`
    (do_sample=False, its own cache) on the same model. Exact mode without padding equals it token for token for
    every method in fp32 and bf16 (where a k-token pass rounds differently from a 1-token one); our plain decoding
    always. (Padded exact mode equals its own padded plain decoding: test_padded_exact_mode_*.)"""
    monkeypatch.setattr(exactness, "PAD_COST", 0.0)  # never pad
    tok = byte_tokenizer()
    target, draft = tiny_model(0).to(dtype), tiny_model(1).to(dtype)
    engine = Engine(target, tok, draft, tok, exact=True)
    for prompt in [*PROMPTS, "hello world, this is a longer prompt"]:  # the last two left plain decoding in
        ids = engine.encode(prompt)  # bf16 when 3-token passes were measured
        hf = target.generate(
            torch.tensor([ids]),
            max_new_tokens=80,
            do_sample=False,
            pad_token_id=256,  # exact
            eos_token_id=256,
        )[0, len(ids) :].tolist()  # after 48 tokens only
        hf = hf[: hf.index(256) + 1] if 256 in hf else hf
        for m in ["autoregressive", *METHODS]:
            ours = engine.generate(prompt, method=m, max_new_tokens=80).token_ids
            assert ours == hf, (m, dtype)


def test_exact_passes_stop_at_the_context_they_were_measured_up_to(ggufs):
    """llama.cpp's 1-token flash-attention pass over 512+ cells splits the cache across threads and sums the parts;
    a longer pass does not. The measurement finds where its pass sizes stop being exact (max_context), and past it
    exact mode decodes plainly: the output of a prompt past max_context equals plain decoding's, with no guess.
    The control: at that context the measured pass size does change bits. (Two threads: the split takes two.)"""
    from specdecode.backends.llamacpp import LlamaLM

    threads = 2
    lm = LlamaLM(ggufs["Q8_0"], threads=threads, exact=True)
    limits = exactness.limits(lm)
    assert limits.max_pass >= 3 and 200 < limits.max_context < 400, limits
    assert limits.guesses(limits.max_context - limits.max_pass) == limits.max_guesses
    assert limits.guesses(limits.max_context) == 0
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 256, (400,), generator=g).tolist()
    assert exactness._exact_at(lm, prompt, exactness.STEPS, limits.max_pass, limits.trees)[0] < limits.max_pass
    engine = Engine(lm, byte_tokenizer(), LlamaLM(ggufs["Q4_0"], threads=threads), byte_tokenizer(), exact=True)
    text = bytes(t % 128 for t in prompt).decode("ascii")  # 400 byte tokens
    plain = engine.generate(text, method="autoregressive", max_new_tokens=24)
    for m in ("draft", "pld"):
        out = engine.generate(text, method=m, max_new_tokens=24)
        assert out.token_ids == plain.token_ids and out.stats.drafted == 0, m


def _state(lm):
    return lm.ids[:], lm.trunk, lm.parent[:], lm.pos[:], lm.cache.get_seq_length()


def test_a_padded_pass_keeps_only_the_real_tokens():
    """LM.pad_rows: a pass of fewer tokens runs as pad_rows rows, and what it leaves (cache entries, tree
    bookkeeping) and returns (one row per real token, or the last) is what an unpadded pass leaves and returns."""
    from specdecode.backends.torch_lm import CachedLM

    model = tiny_model(0)
    plain, pad = CachedLM(model), CachedLM(model)
    pad.pad_rows = 4
    prompt = list(b"the cat sat on the")
    for lm in (plain, pad):
        lm.forward(prompt, last_only=True)
    P = len(prompt)
    steps = [
        ([5], None, False),
        ([6, 7], None, False),
        ([8], None, True),  # chains, last_only
        ([9, 10, 11], [P + 3, P + 4, P + 4], False),
    ]  # a tree: root 9 (off the last entry) with two children
    for ids, parents, last in steps:
        a, b = plain.forward(ids, last_only=last, parents=parents), pad.forward(ids, last_only=last, parents=parents)
        assert a.shape == b.shape == (1 if last else len(ids), 257)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert _state(plain) == _state(pad)
    for lm in (plain, pad):
        lm.rollback(P + 4, [P + 4, P + 5])  # accept the root and its first child
    torch.testing.assert_close(plain.forward([12]), pad.forward([12]), atol=1e-4, rtol=1e-4)
    assert _state(plain) == _state(pad) and pad.cache.get_seq_length() == P + 7


class OneRowKernel(CachedLM):
    """A backend whose 1-row passes take another kernel than longer ones, as oneDNN and cuBLAS do: its 1-row
    logits are offset by a constant (the argmax never moves; every bit of the row does). On a tiny bf16 model with
    eager attention, passes of 2+ rows are exact against each other on the CPUs seen (measured below)."""

    def _pass(self, new_ids, last_only, parents):
        out = super()._pass(new_ids, last_only, parents)
        return out + 2.0**-6 if len(new_ids) == 1 else out


def _padded_engine(monkeypatch, cost: float) -> Engine:
    """An exact engine on OneRowKernel whose measured padding cost is `cost`; the draft is the target's weights, so
    guesses are accepted and passes of every allowed size run."""
    monkeypatch.setattr(exactness, "padding_cost", lambda lm, *a, **k: cost)
    tok, model = byte_tokenizer(), tiny_model(0).to(torch.bfloat16)
    model.config._attn_implementation = "eager"
    return Engine(OneRowKernel(model), tok, model, tok, exact=True)


def test_padded_exact_mode_reads_padded_plain_decodings_bits(monkeypatch):
    """Where a 1-row pass takes its own kernel, no unpadded pass beyond 1 token is exact; exact mode then pads every
    target pass to 2 rows if that makes longer passes exact and costs little: every method's output equals padded
    plain decoding's, every verifier row bit for bit, and every target pass of an exact generation ran 2+ rows.
    The control: the same pass sizes without the padding change bits."""
    engine = _padded_engine(monkeypatch, 1.0)
    limits = engine.exact_limits()
    assert exactness.measure(engine.target).max_pass == 1 and engine.target.pad_rows == 1
    if "no longer pass exact either" in limits.checked:  # exactness.choose measured the padded passes
        pytest.skip("on this CPU even 2+-row bf16 passes of the tiny model differ from each other")
    assert limits.pad_rows == 2 and limits.max_pass >= 2 and "padded to 2 rows" in limits.checked, limits
    rows_seen = []  # (rows, padding on) of every target pass
    lm, real = engine.target, engine.target._pass
    monkeypatch.setattr(lm, "_pass", lambda ids, *a: rows_seen.append((len(ids), lm.pad_rows)) or real(ids, *a))
    for prompt in PROMPTS:
        plain, rows = _recorded(engine, prompt, "autoregressive", NEW)
        for m in METHODS:
            r = check_greedy(engine, prompt, m, NEW, plain.token_ids, rows)
            assert r["identical"] and r["passed"], (m, r)
            assert r["bit_identical"] == r["positions_compared"] == len(plain.token_ids), (m, r)
    padded = [n for n, pad in rows_seen if pad == 2]  # (1-row passes outside generations: the cost model's timing)
    assert min(padded) == 2 and max(padded) > 2  # padded steps, and verification passes of several tokens
    assert engine.target.pad_rows == 1  # no padding outside exact generations
    engine._exact_limits = replace(limits, pad_rows=1)  # the control
    plain, rows = _recorded(engine, PROMPTS[1], "autoregressive", NEW)
    r = check_greedy(engine, PROMPTS[1], "draft", NEW, plain.token_ids, rows)
    assert r["accepted"] > 0 and not r["passed"] and r["bit_identical"] < r["positions_compared"], r


def test_exact_mode_does_not_pad_where_padding_costs_too_much(monkeypatch):
    limits = _padded_engine(monkeypatch, 1.5).exact_limits()
    assert limits.pad_rows == 1 and limits.max_pass == 1 and "not tried" in limits.checked


@pytest.mark.parametrize("reread", ["plain", "batched"])
def test_a_context_made_anew_mid_generation_keeps_plain_decodings_bits(ggufs, monkeypatch, reread):
    """Where a generation's context is made anew (parked cells used up its slack), the text is read again as plain
    decoding read it: the prompt in passes of n_batch, then one token a pass; the logits after it keep plain
    decoding's bits. Control ("batched"): the output read again in one pass, as the prompt is, changes them."""
    from specdecode.backends.llamacpp import lm as llamacpp

    monkeypatch.setattr(llamacpp, "FIRST_CTX", 64)  # a small first context, so that reserve makes a new one
    lm = llamacpp.LlamaLM(ggufs["Q4_K_M"], threads=1, exact=True)
    prompt = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    ids, ref = exactness._plain(lm, prompt, 32)
    lm.reset()
    lm.forward(prompt, last_only=True)
    lm.prompt_read = len(prompt) if reread == "plain" else len(prompt) + 16
    for t in ids[:16]:
        lm.forward([t])
    before = lm._cells
    lm.reserve(lm._cells - llamacpp.MAX_SEQ + 1)  # more than the context holds: a new one, the text read again
    assert lm._cells > before and lm.ids == prompt + ids[:16] and lm.parked == 0
    rows = torch.cat([lm.forward([t]) for t in ids[16:]])
    assert torch.equal(rows, ref[16:]) == (reread == "plain")


@pytest.mark.parametrize("method", ["tree", "draft"])
def test_a_generation_whose_context_is_made_anew_keeps_plain_decodings_bits(ggufs, monkeypatch, method):
    """The context made anew mid-generation (as when parked cells use up its slack): the rest of the output still
    reads plain decoding's bits, every row."""
    from specdecode.backends.llamacpp import lm as llamacpp

    monkeypatch.setattr(llamacpp, "FIRST_CTX", 64)
    engine = engine_on(ggufs["Q4_K_M"])
    lm = engine.target
    prompt = PROMPTS[1]
    plain, rows = _recorded(engine, prompt, "autoregressive", NEW)
    real, made = lm.rollback, []

    def rollback(length, path=()):
        real(length, path)
        if not made and len(lm) > len(prompt) + 8:
            before = lm._cells
            lm.reserve(lm._cells - llamacpp.MAX_SEQ + 1)  # more than it holds: a new context, the text read again
            made.append(lm._cells > before)

    monkeypatch.setattr(lm, "rollback", rollback)
    r = check_greedy(engine, prompt, method, NEW, plain.token_ids, rows)
    assert made == [True]
    assert r["passed"] and r["bit_identical"] == r["positions_compared"] == len(plain.token_ids), str(r)
