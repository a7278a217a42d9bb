"""The llama.cpp context grows with the text (LlamaLM.reserve): it starts at FIRST_CTX cells, like
llama-cpp-python's Llama, because a large context makes each step slower (values are stored transposed
with the cell count as row stride), and doubles when a generation needs more."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("llama_cpp", reason="the llama.cpp backend needs llama-cpp-python (not installed)")

import specdecode.backends.llamacpp as llamacpp_mod  # noqa: E402
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
