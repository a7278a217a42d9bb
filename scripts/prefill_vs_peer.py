"""Prefill and decode step of our llama.cpp backend against llama-cpp-python's own Llama on the same
GGUF file, threads and prompt: where does plain decoding lose to the peer?

    python scripts/prefill_vs_peer.py [--tokens 1400] [--steps 32] [--repeats 3]

Prints seconds of the prefill and of one decode step (median) for: ours as configured, ours with flash
attention off (the peer's default), and the peer (Llama.eval / one more token).
"""

from __future__ import annotations

import argparse
import statistics
import time

from specdecode.backends import DEFAULT_TARGET, load_lm
from specdecode.backends.llamacpp import LlamaLM


def ours(path, threads, ids, steps, **kw):
    lm = LlamaLM(path, threads=threads, **kw)
    lm.forward(ids[:64], last_only=True)  # warm-up
    lm.reset()
    t = time.perf_counter()
    lm.forward(ids[:-1], last_only=True)
    prefill = time.perf_counter() - t
    times = []
    for i in range(steps):  # the same tokens for both (a step costs the same whatever the token)
        t = time.perf_counter()
        lm.forward([ids[i]])
        times.append(time.perf_counter() - t)
    return prefill, statistics.median(times)


def peer(path, threads, ids, steps):
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path), n_ctx=4096, n_threads=threads, n_threads_batch=threads, n_gpu_layers=0, verbose=False
    )
    llm.eval(ids[:64])
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids[:-1])
    prefill = time.perf_counter() - t
    times = []
    for i in range(steps):
        t = time.perf_counter()
        llm.eval([ids[i]])
        times.append(time.perf_counter() - t)
    return prefill, statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1400)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    target, tok, _ = load_lm(DEFAULT_TARGET, "llama.cpp", progress=False)
    path, threads = target.path, target.threads
    del target
    text = open(__file__).read() * 20
    ids = tok(text)["input_ids"][: args.tokens]
    import llama_cpp as lc

    runs = {
        "ours (flash attention auto)": lambda: ours(path, threads, ids, args.steps),
        "ours (flash attention off)": lambda: ours(
            path, threads, ids, args.steps, flash_attn=lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        ),
        "llama-cpp-python Llama": lambda: peer(path, threads, ids, args.steps),
    }
    results = {name: [] for name in runs}
    for _ in range(args.repeats):  # interleaved
        for name, run in runs.items():
            results[name].append(run())
    for name, rs in results.items():
        pf = min(r[0] for r in rs)
        st = min(r[1] for r in rs)
        print(
            f"{name:32s} prefill {len(ids) - 1} tokens {pf:6.2f} s ({(len(ids) - 1) / pf:5.1f} tok/s), "
            f"decode step at that context {st * 1000:6.1f} ms"
        )


if __name__ == "__main__":
    main()
