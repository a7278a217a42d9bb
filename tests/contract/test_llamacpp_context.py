"""The llama.cpp context's size (LlamaLM.reserve): it starts at FIRST_CTX cells, like llama-cpp-python's Llama,
because a large context makes each step slower (values are stored transposed with the cell count as row stride),
and doubles while a generation needs more: sized before the prompt's read for the prompt and max_new_tokens, so
that no generation stops mid-way to move or read its text again. A context made anew keeps the text cached in it
(its keys and values copied; exact mode reads it again, asking the interrupt between the passes)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llama_cpp", reason="the llama.cpp backend needs llama-cpp-python (not installed)")

import specdecode.backends.llamacpp.lm as llamacpp_mod  # noqa: E402
from specdecode import Engine  # noqa: E402
from specdecode.backends import load_lm  # noqa: E402
from specdecode.backends.llamacpp import MAX_SEQ, LlamaLM  # noqa: E402
from specdecode.errors import Interrupted  # noqa: E402
from tinygguf import write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "t.gguf", 0, ctx=2048)


def test_context_starts_small_and_grows_with_the_text(gguf, monkeypatch):
    monkeypatch.setattr(llamacpp_mod, "FIRST_CTX", 64)
    lm = LlamaLM(gguf, threads=1)
    first = lm._cells  # llama.cpp rounds 64 + MAX_SEQ up to its own granularity
    assert lm.max_length == 2048 and first < 1024
    ids = [(5 * i + 3) % 200 for i in range(1200)]
    lm.forward(ids[:500], last_only=True)
    out = lm.forward(ids[500:900], last_only=True)  # grows on its own when a pass needs it (text read again)
    assert lm._cells >= 900 + MAX_SEQ and lm._cells > first and len(lm) == 900
    lm.reset()
    lm.reserve(1100)  # an empty cache: a new, bigger context, nothing to read again
    assert lm._cells >= 1100 + MAX_SEQ and len(lm) == 0
    monkeypatch.setattr(llamacpp_mod, "FIRST_CTX", 4096)
    fresh = LlamaLM(gguf, threads=1)  # never grown
    fresh.forward(ids[:500], last_only=True)
    ref = fresh.forward(ids[500:900], last_only=True)
    assert torch.allclose(out, ref, atol=5e-3)


def test_engine_reserves_the_whole_generation(gguf, monkeypatch):
    monkeypatch.setattr(llamacpp_mod, "FIRST_CTX", 32)
    target, tok, _ = load_lm(str(gguf), "llama.cpp", threads=1, progress=False)
    engine = Engine(target, tok)
    prompt = "abc " * 200
    first = target._cells
    out = engine.generate(prompt, method="autoregressive", max_new_tokens=50)
    n = len(engine.encode(prompt)) + 50
    assert n + MAX_SEQ > first and target._cells >= n + MAX_SEQ  # reserved before the prefill
    monkeypatch.setattr(llamacpp_mod, "FIRST_CTX", 4096)
    big, tok2, _ = load_lm(str(gguf), "llama.cpp", threads=1, progress=False)
    again = Engine(big, tok2).generate(prompt, method="autoregressive", max_new_tokens=50)
    assert out.token_ids == again.token_ids


def test_flash_attention_off_by_default(gguf):
    import llama_cpp as lc

    assert LlamaLM(gguf, threads=1)._cparams.flash_attn_type == lc.LLAMA_FLASH_ATTN_TYPE_DISABLED


def test_every_pass_runs_on_one_compute_thread_whoever_asks(gguf, monkeypatch):
    """libgomp keeps an OpenMP pool per thread that ran a pass, and with more pool threads than CPUs its
    barriers sleep instead of spinning (a 1-token pass 64 -> 82-90 ms on a 2-vCPU Xeon from a server's worker
    thread): every llama_decode goes through backends.compute's one thread, from any thread, slots included."""
    import threading

    from specdecode.backends import compute, slots as make_slots
    from specdecode.backends.llamacpp.batching import Lockstep

    lm = LlamaLM(gguf, threads=1)
    callers, real = [], lm._lc.llama_decode

    def spy(ctx, batch):
        callers.append(threading.get_ident())
        return real(ctx, batch)

    monkeypatch.setattr(lm._lc, "llama_decode", spy)
    ids = [(5 * i + 3) % 200 for i in range(40)]
    ref = lm.forward(ids, last_only=True)
    got = []
    threads = [
        threading.Thread(target=lambda: (lm.reset(), got.append(lm.forward(ids, last_only=True)))) for _ in range(2)
    ]
    for t in threads:
        t.start()
        t.join()
    slot = make_slots(lm, 2, 512, Lockstep(), None)[1]
    threads = [threading.Thread(target=lambda: got.append(slot.forward(ids, last_only=True)))]
    threads[0].start()
    threads[0].join()
    assert len(got) == 3 and all(torch.allclose(g[-1], ref[-1], atol=5e-3) for g in got)
    assert len(callers) >= 4 and len(set(callers)) == 1 and callers[0] != threading.get_ident()
    assert compute.call(threading.get_ident) == callers[0]


def test_a_forked_child_gets_its_own_compute_thread(gguf):
    """After a fork the child has no compute thread (threads do not survive fork): its first pass starts one
    instead of waiting forever on the parent's."""
    import multiprocessing
    import os

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    lm = LlamaLM(gguf, threads=1)
    lm.forward([1, 2, 3], last_only=True)  # the parent's compute thread exists now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one pass, then report and leave without running the parent's cleanup
        try:
            lm.reset()
            row = lm.forward([1, 2, 3], last_only=True)
            os.write(w, b"ok" if torch.isfinite(row).all() else b"nan")
        finally:
            os._exit(0)
    os.close(w)
    import select

    ready, _, _ = select.select([r], [], [], 60)
    out = os.read(r, 16) if ready else b"timeout"
    os.waitpid(pid, 0) if ready else (os.kill(pid, 9), os.waitpid(pid, 0))
    assert out == b"ok"


def test_a_generation_without_a_length_does_not_keep_the_context_grown(gguf, monkeypatch):
    """A server's request without max_tokens may run to the end of the context: room for it is made as the text
    grows, not all of it up front, and a context that grew shrinks back when a later generation starts on an
    empty cache (a bigger context makes every step slower, and holds more memory)."""
    import specdecode.prefill as prefill_mod

    monkeypatch.setattr(llamacpp_mod, "FIRST_CTX", 64)
    monkeypatch.setattr(prefill_mod, "RESERVE_AHEAD", 128, raising=False)
    target, tok, _ = load_lm(str(gguf), "llama.cpp", threads=1, progress=False)
    engine = Engine(target, tok)
    first = target._cells
    prompt = "abc " * 20
    room = target.max_length - len(engine.encode(prompt))  # the server's default for a chat without max_tokens
    stream = engine.stream(prompt, method="autoregressive", max_new_tokens=room)
    for i, _ in enumerate(stream):
        if i == 8:
            break  # an answer that ends early, as most do
    assert target._cells == first < 1024 < target.max_length
    target.reset()
    target.reserve(1500)  # a long generation grew it
    assert target._cells >= 1500 + MAX_SEQ
    short = engine.generate(prompt, method="autoregressive", max_new_tokens=20)
    assert target._cells == first  # back to what this generation needs
    # a generation that outgrows what was reserved up front: the same tokens as one with room from the start
    grown = engine.generate(prompt, method="autoregressive", max_new_tokens=300)
    monkeypatch.setattr(llamacpp_mod, "FIRST_CTX", 4096)
    big, tok2, _ = load_lm(str(gguf), "llama.cpp", threads=1, progress=False)
    ref = Engine(big, tok2).generate(prompt, method="autoregressive", max_new_tokens=300)
    assert grown.token_ids == ref.token_ids and short.token_ids == ref.token_ids[: len(short.token_ids)]


def _watched(monkeypatch, lm):
    """What happens to lm's context: `made`, the cached tokens at each context made anew; `starts`, the passes that
    begin at position 0 (a prompt's read, or the text read again)."""
    made, starts = [], []
    new_context, decode = lm._new_context, lm._decode

    def spy_new(cells):
        made.append(len(lm.ids))
        new_context(cells)

    def spy_decode(tokens):
        starts.extend(t[1] for t in tokens[:1] if t[1] == 0)
        return decode(tokens)

    monkeypatch.setattr(lm, "_new_context", spy_new)
    monkeypatch.setattr(lm, "_decode", spy_decode)
    return made, starts


@pytest.mark.parametrize("method", ["autoregressive", "draft"])
def test_a_long_generation_is_sized_up_front_and_never_moves_its_text(gguf, monkeypatch, method):
    """prompt + max_new_tokens far beyond the first context and the old reserve ahead: the target's and the draft's
    contexts are made on empty caches, before the prompt's read, with room for the whole generation; while it runs no
    context is made anew and no text is read again (each model reads position 0 once)."""
    import specdecode.prefill as prefill_mod

    monkeypatch.setattr(llamacpp_mod, "FIRST_CTX", 64)
    monkeypatch.setattr(prefill_mod, "RESERVE_AHEAD", 64)
    target, tok, _ = load_lm(str(gguf), "llama.cpp", threads=1, progress=False)
    draft, _, _ = load_lm(str(gguf), "llama.cpp", threads=1, progress=False)
    engine = Engine(target, tok, draft, tok)
    first = target._cells
    watched = [_watched(monkeypatch, lm) for lm in (target, draft)]
    prompt = "def f(x):\n    return x\n" * 12
    n = len(engine.encode(prompt))
    out = engine.generate(prompt, method=method, max_new_tokens=900)
    assert n + len(out.token_ids) > first  # the text outgrew the first context
    assert target._cells >= n + 900 + MAX_SEQ
    for (made, starts), used in zip(watched, (True, method == "draft")):
        assert (made, starts) == (([0], [0]) if used else ([], []))


@pytest.mark.parametrize("how", ["exact", "copy fails"])
def test_a_reread_asks_the_interrupt_between_its_passes(gguf, monkeypatch, how):
    """Where a context made anew must read its text again (exact mode; a failed copy of its keys and values), a
    cancelled request stops that read after the pass under way; without a cancel the whole text is read."""
    monkeypatch.setattr(llamacpp_mod, "FIRST_CTX", 1024)  # the text fits; reserve(1500) makes a bigger context
    text = [(5 * i + 3) % 200 for i in range(1100)]
    for cancel in (True, False):
        lm = LlamaLM(gguf, threads=1, exact=how == "exact")
        if how == "copy fails":
            monkeypatch.setattr(lm, "_text_state", lambda: None)
        lm.forward(text, last_only=True)
        lm.mark_prompt()
        passes, decode = [], lm._decode
        monkeypatch.setattr(lm, "_decode", lambda tokens: (passes.append(len(tokens)), decode(tokens))[1])
        lm.interrupt = (lambda: len(passes) >= 1) if cancel else (lambda: False)
        if cancel:
            with pytest.raises(Interrupted):
                lm.reserve(1500)
            assert passes == [512] and len(lm.ids) == lm.trunk == 512
        else:
            lm.reserve(1500)
            assert passes == [512, 512, 76] and lm.ids == text
        assert lm._cells >= 1500 + MAX_SEQ


def test_a_cancel_during_a_reread_ends_the_stream(gguf, monkeypatch):
    """A generation without a budget (it may run to the context's end) that outgrows its context while the text must
    be read again: the stream's interrupt stops it between the passes of that read, and the stream ends as an
    interrupted one does (no error)."""
    import specdecode.prefill as prefill_mod

    monkeypatch.setattr(llamacpp_mod, "FIRST_CTX", 64)
    monkeypatch.setattr(prefill_mod, "RESERVE_AHEAD", 64)
    target, tok, _ = load_lm(str(gguf), "llama.cpp", threads=1, progress=False)
    monkeypatch.setattr(target, "_text_state", lambda: None)
    engine = Engine(target, tok)
    prompt = "abc " * 150
    n = len(engine.encode(prompt))
    made, starts = _watched(monkeypatch, target)
    stream = engine.stream(prompt, method="autoregressive", max_new_tokens=target.max_length - n)
    stream.stop_when(lambda: len(starts) >= 2)  # the text began to be read again
    for _ in stream:
        pass
    assert len(made) == 2 and made[1] > n and starts == [0, 0]
    assert len(target.ids) == 512 and target.interrupt is None


def test_a_grown_context_shrinks_back_with_a_kept_prefix(gguf, monkeypatch):
    """The prompt cache keeps a conversation's start; a long generation grew the context: the next, short one gets a
    small context again, with the kept prefix moved into it (not read again) and the same tokens as without it."""
    monkeypatch.setattr(llamacpp_mod, "FIRST_CTX", 64)
    target, tok, _ = load_lm(str(gguf), "llama.cpp", threads=1, progress=False)
    engine = Engine(target, tok, prompt_cache=True)
    first = target._cells
    system = "You answer in one line. " * 6
    engine.generate(system + "Write a long story.", method="autoregressive", max_new_tokens=900, cache_scope="k")
    assert target._cells > first
    made, starts = _watched(monkeypatch, target)
    short = engine.generate(system + "Say hi.", method="autoregressive", max_new_tokens=20, cache_scope="k")
    assert short.stats.cached_prompt_tokens > 100 and target._cells == first
    assert made and made[0] >= 100 and starts == []  # made anew holding the prefix, which was never read again
    fresh, tok2, _ = load_lm(str(gguf), "llama.cpp", threads=1, progress=False)
    ref = Engine(fresh, tok2).generate(system + "Say hi.", method="autoregressive", max_new_tokens=20)
    assert short.token_ids == ref.token_ids
