"""Other tools' decoders, measured in the same bench run: llama-cpp-python's own generation (plain, and
with its prompt lookup), transformers' assisted generation with our draft model, and llama.cpp's own
llama-server (plain, with our draft model, with its n-gram speculation: server_peer.py)."""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from ..engine import METHODS, Engine
from ..errors import SpecDecodeError
from ..methods import METHOD_TABLE
from .server_peer import SERVER_PEERS

# other tools' decoders, measured in the same run
PEERS = ("hf-assisted", "llama.cpp", "llama.cpp-pld", *SERVER_PEERS)
DRAFT_PEERS = ("hf-assisted", "llama-server-draft")  # the peers that run our draft model
BENCH_METHODS = (*METHODS, *PEERS)


def _is(m: str, need: str) -> bool:
    """Whether method m (a name in the method table; a peer never) has the table's flag `need`."""
    return m in METHOD_TABLE and bool(getattr(METHOD_TABLE[m], need))


@contextmanager
def _extra_buffers(on: bool):
    """llama-cpp-python's Llama has no setting for llama.cpp's extra (repacked, AMX) weight buffers: while
    `on` is False, the default model parameters it starts from have them off."""
    import llama_cpp.llama_cpp as c
    default = c.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p
    if not on:
        c.llama_model_default_params = params
    try:
        yield
    finally:
        c.llama_model_default_params = default


class LlamaPeer:
    """llama-cpp-python's own high-level greedy generation on the same GGUF file and thread count
    (with its LlamaPromptLookupDecoding for llama.cpp-pld): what a user would run instead of us."""

    def __init__(self, engine: Engine, pld: bool):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        from .load_peers import DEFAULT_CTX
        lm = engine.target
        self.eos = engine.eos_ids
        with _extra_buffers(lm.repack):  # as our target runs: off where this build's AMX kernels crash
            self.llm = Llama(model_path=str(lm.gguf_path), n_ctx=min(lm.max_length, DEFAULT_CTX), n_threads=lm.threads,
                             n_threads_batch=lm.threads, n_gpu_layers=0, verbose=False,
                             draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10) if pld else None)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed) -> dict:
        if temperature != 0:
            raise SpecDecodeError("the llama.cpp peers are benchmarked greedy only (--temperature 0)")
        self.llm.reset()  # no prefix reuse from the previous prompt: each run prefills, as ours do
        ids = []
        ttft = None
        t = time.perf_counter()
        for tok in self.llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                     reset=True):
            if ttft is None:  # the first token out: the prefill and one sampling step
                ttft = time.perf_counter() - t
            ids.append(int(tok))
            if tok in self.eos or len(ids) >= max_new_tokens:
                break
        wall = time.perf_counter() - t
        return {"token_ids": ids, "new_tokens": len(ids), "wall_s": wall, "ttft_s": ttft}


def hf_assisted(engine: Engine, prompt_ids: list[int], gamma: int, max_new_tokens: int,
                temperature: float, seed: int | None) -> dict:
    """The peer: transformers' assisted generation with the same models (its default schedule)."""
    target, draft = engine.target.hf_model, engine.draft_model.lm.hf_model
    x = torch.tensor([prompt_ids], device=engine.target.device)
    # neutral settings, so that a checkpoint's own generation config (repetition penalty, top-p...) does
    # not make the peer decode a different distribution; its assistant schedule stays HF's default
    kwargs = dict(top_k=None, top_p=None, repetition_penalty=None)
    kwargs.update(dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature))
    if seed is not None:
        torch.manual_seed(seed)
    draft.generation_config.num_assistant_tokens = gamma
    t = time.perf_counter()
    out = target.generate(x, attention_mask=torch.ones_like(x), assistant_model=draft, max_new_tokens=max_new_tokens,
                          eos_token_id=sorted(engine.eos_ids) or None,
                          pad_token_id=min(engine.eos_ids, default=None), **kwargs)
    wall = time.perf_counter() - t
    ids = out[0, len(prompt_ids):].tolist()
    # generate() returns everything at once: no time to first token (so no decode speed either)
    return {"token_ids": ids, "new_tokens": len(ids), "wall_s": wall, "ttft_s": None}
