"""The llama.cpp peers' process: llama-cpp-python's own greedy generation, run by path (never imported, so
neither torch nor specdecode is loaded here) as a child of `specdecode bench` (peers.LlamaPeer).

Why a process of its own: two llama.cpp models loaded in one process do not decode at the same speed (the one
loaded first is slower, whichever it is: docs/results/notes.md#code-peer-process), so an in-process peer measures
the load order.

Protocol, one JSON object per line: the parent writes the settings, the child answers {"ready": true}; then
each request {"prompt_ids", "max_new_tokens", "eos"} is answered {"token_ids", "new_tokens", "wall_s",
"ttft_s"} or {"error": "..."}; end of input ends the child. Times are taken here, around the generation only,
as our engine's are."""

import json
import os
import sys
import time


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever llama.cpp prints goes to stderr, never between the replies
    cfg = json.loads(sys.stdin.readline())
    import llama_cpp.llama_cpp as c
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    if not cfg["repack"]:  # as our target runs: llama.cpp's extra (repacked, AMX) weight buffers off
        default = c.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p

        c.llama_model_default_params = params
    try:
        llm = Llama(
            model_path=cfg["model_path"],
            n_ctx=cfg["n_ctx"],
            n_threads=cfg["threads"],
            n_threads_batch=cfg["threads"],
            n_gpu_layers=0,
            verbose=False,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10) if cfg["pld"] else None,
        )
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        replies.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        return
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        try:
            replies.write(json.dumps(generate(llm, req["prompt_ids"], req["max_new_tokens"], set(req["eos"]))) + "\n")
        except Exception as e:  # noqa: BLE001
            replies.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")


def generate(llm, prompt_ids: list[int], max_new_tokens: int, eos: set[int]) -> dict:
    llm.reset()  # no prefix reuse from the previous prompt: each run prefills, as ours do
    ids: list[int] = []
    ttft = None
    t = time.perf_counter()
    for tok in llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        if ttft is None:  # the first token out: the prefill and one sampling step
            ttft = time.perf_counter() - t
        ids.append(int(tok))
        if tok in eos or len(ids) >= max_new_tokens:
            break
    wall = time.perf_counter() - t
    return {"token_ids": ids, "new_tokens": len(ids), "wall_s": wall, "ttft_s": ttft}


if __name__ == "__main__":
    main()
