"""The llama.cpp context grows with the text (LlamaLM.reserve): it starts at FIRST_CTX cells, like
llama-cpp-python's Llama, because a large context makes each step slower (values are stored transposed
with the cell count as row stride), and doubles when a generation needs more."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("llama_cpp", reason="the llama.cpp backend needs llama-cpp-python (not installed)")

import specdecode.backends.llamacpp.lm as llamacpp_mod  # noqa: E402
from specdecode import Engine  # noqa: E402
from specdecode.backends import load_lm  # noqa: E402
from specdecode.backends.llamacpp import MAX_SEQ, LlamaLM  # noqa: E402
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

    from specdecode.backends import slots as make_slots
    from specdecode.backends import compute
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
    threads = [threading.Thread(target=lambda: (lm.reset(), got.append(lm.forward(ids, last_only=True))))
               for _ in range(2)]
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
    assert grown.token_ids == ref.token_ids and short.token_ids == ref.token_ids[:len(short.token_ids)]
