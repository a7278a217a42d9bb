"""Exact greedy mode and pass costs on a CUDA GPU, with models of the default pair's shapes (and the bound they set for
served speed). The device machine reaches no network and takes no weights along, so the models are random-initialised
from the default pair's configs (Qwen2.5-Coder-1.5B / 0.5B, bf16, sdpa attention): kernel paths and pass costs depend on
the shapes, not on the weights' values. A random model's logits are nearly flat (near-ties everywhere), which makes any
differing bit show up as a differing token sooner than a trained model would.

Measures, writing results.json after every step (a cut-off run keeps what it had):
1. T(k): one pass over k new tokens after 128 cached, median of 5;
2. with --probe: exactness.measure with every pass padded to p rows (p = 1, 2, 4, 8, 16; LM.pad_rows);
3. the library's own choice (exactness.padding_cost, Engine.exact_limits);
4. per prompt (HumanEval: MIT; MT-bench: Apache-2.0): exact-mode autoregressive and every method, each compared
   token for token and every verifier row bit for bit (certify.check_greedy); default-mode autoregressive and
   draft, with times; where exact mode pads, the control without the padding.
The draft is the target itself (full acceptance: the verifier reads passes of every allowed size). The first GPU
run (docs/results/exact-gpu-h200/probe-padded.json) came from an earlier version of this script whose
measurement checked passes at even positions only.

    python scripts/gpu_exact_probe.py --model-dir DIR --prompts FILE --out DIR [--probe]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specdecode import Engine, exactness
from specdecode.backends.torch_lm import CachedLM
from specdecode.certify import _recorded, check_greedy

METHODS = ["auto", "draft", "pld", "tree", "lookup"]


def build(model_dir: str, seed: int, device: str):
    cfg = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def pass_costs(lm, contexts=(128, 1024), sizes=(1, 2, 3, 4, 8, 16, 32, 64)) -> dict:
    g = torch.Generator().manual_seed(1)
    out = {}
    for c in contexts:
        lm.reset()
        lm.forward(torch.randint(0, 30000, (c,), generator=g).tolist(), last_only=True)
        row = {}
        for k in sizes:
            toks = torch.randint(0, 30000, (k,), generator=g).tolist()
            times = []
            for i in range(7):
                t = time.perf_counter()
                lm.forward(toks)
                lm.synchronize()
                times.append(time.perf_counter() - t)
                lm.rollback(c)
            row[k] = statistics.median(times[2:])
        out[c] = {k: round(v * 1000, 3) for k, v in row.items()}
    lm.reset()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--prompts", required=True, help="jsonl: {category, prompt} (a string or chat messages)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=420, help="stop starting prompts after this many seconds")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--probe", action="store_true", help="also measure exactness padded to 1, 2, 4, 8, 16 rows")
    ap.add_argument("--pad-cost", type=float, default=exactness.PAD_COST, help="exactness.PAD_COST for this run")
    a = ap.parse_args()
    exactness.PAD_COST = a.pad_cost
    t0 = time.perf_counter()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {
        "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else a.device,
        "torch": torch.__version__,
        "model": a.model_dir,
        "weights": "random (shapes of the default pair's target)",
        "dtype": "bf16",
        "rows": [],
    }
    save = lambda: (out / "results.json").write_text(json.dumps(res, indent=1))  # noqa: E731
    model = build(a.model_dir, 0, a.device)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    lm = CachedLM(model)
    res["pass_ms"] = pass_costs(lm, contexts=(128,), sizes=(1, 2, 4, 8, 16, 32))
    print("pass ms", res["pass_ms"], flush=True)
    if a.probe:
        res["exact"] = {}
        for p in (1, 2, 4, 8, 16):
            res["exact"][p] = exactness.measure(lm, pad_rows=p).__dict__
            print("pad", p, res["exact"][p], flush=True)
    engine, default = Engine(model, tok, model, tok, exact=True), Engine(model, tok, model, tok)
    engine.progress = default.progress = False
    t = time.perf_counter()
    res["padding_cost"] = exactness.padding_cost(engine.target)
    limits = engine.exact_limits()  # the library's choice: exactness.choose
    res["limits"], res["limits_s"] = limits.__dict__, round(time.perf_counter() - t, 1)
    print("padding cost", res["padding_cost"], "limits", res["limits"], flush=True)
    save()
    for e, ms in ((engine, ["autoregressive", *METHODS]), (default, ["autoregressive", "draft"])):
        for m in ms:
            e.generate("def f(x):", method=m, max_new_tokens=8)
    for line in Path(a.prompts).read_text().splitlines():
        if time.perf_counter() - t0 > a.budget_s:
            res["stopped"] = "budget"
            break
        row = json.loads(line)
        prompt, n = row["prompt"], a.max_new_tokens
        r = {"category": row["category"], "wall": {}, "tau": {}, "same": {}, "bits": {}}
        t = time.perf_counter()
        ref, rows = _recorded(engine, prompt, "autoregressive", n)
        r["wall"]["exact/autoregressive"] = round(time.perf_counter() - t, 3)
        for m in METHODS:
            t = time.perf_counter()
            c = check_greedy(engine, prompt, m, n, ref.token_ids, rows)
            r["wall"][f"exact/{m}"] = round(time.perf_counter() - t, 3)
            r["same"][m] = c["identical"] and c["passed"]
            r["bits"][m] = f"{c['bit_identical']}/{c['positions_compared']}"
            r["tau"][f"exact/{m}"] = round(1 + c["accepted"] / max(1, c["tokens"] - c["accepted"]), 2)
        dflt = {m: timed(default, prompt, m, n, r, f"default/{m}") for m in ("autoregressive", "draft")}
        r["same"]["default_draft_vs_default_ar"] = dflt["draft"].token_ids == dflt["autoregressive"].token_ids
        r["same"]["exact_ar_vs_default_ar"] = ref.token_ids == dflt["autoregressive"].token_ids
        r["tokens"] = len(ref.token_ids)
        res["rows"].append(r)
        print(r, flush=True)
        save()
    if limits.pad_rows > 1:  # the control: the same pass sizes without the padding
        engine._exact_limits = replace(limits, pad_rows=1)
        prompt = json.loads(Path(a.prompts).read_text().splitlines()[0])["prompt"]
        ref, rows = _recorded(engine, prompt, "autoregressive", 64)
        c = check_greedy(engine, prompt, "draft", 64, ref.token_ids, rows)
        res["control_unpadded"] = {k: c[k] for k in ("identical", "passed", "bit_identical", "positions_compared")}
        print("control", res["control_unpadded"], flush=True)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    save()


def timed(engine, prompt, method, n, r, key):
    t = time.perf_counter()
    o = engine.generate(prompt, method=method, max_new_tokens=n)
    r["wall"][key] = round(time.perf_counter() - t, 3)
    r["tau"][key] = o.stats.mean_accepted_tokens
    return o


if __name__ == "__main__":
    main()
