"""Exact greedy mode on torch (issue 17): the measured exact pass sizes of the default pair's target in bf16,
and every method's greedy output against exact autoregressive's on a few prompts (HumanEval: MIT; MT-bench:
Apache-2.0). Prints one line per prompt and a summary; run on a quiet machine.

    python scripts/exact_torch.py --humaneval 5 --mtbench 3
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdecode import Engine, exactness
from specdecode.bench import cpu_description

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
METHODS = ["auto", "draft", "pld", "tree", "lookup"]

ap = argparse.ArgumentParser()
ap.add_argument("--humaneval", type=int, default=5)
ap.add_argument("--mtbench", type=int, default=3)
ap.add_argument("--max-new-tokens", type=int, default=128)
a = ap.parse_args()
engine = Engine.load(backend="torch", exact=True, progress=False)
t = time.perf_counter()
limits = exactness.limits(engine.target)
print(cpu_description())
print(f"target {engine.target.name} {engine.target.dtype}: {limits} (measured in {time.perf_counter() - t:.0f} s)")
he = [json.loads(x)["prompt"] for x in (DATA / "humaneval.jsonl").read_text().splitlines()[:a.humaneval]]
mt = [[{"role": "user", "content": json.loads(x)["turns"][0]}]
      for x in (DATA / "mt_bench.jsonl").read_text().splitlines()[:a.mtbench]]
same_all = 0
for prompt in he + mt:
    ref = engine.generate(prompt, method="autoregressive", max_new_tokens=a.max_new_tokens)
    same = {m: engine.generate(prompt, method=m, max_new_tokens=a.max_new_tokens).token_ids == ref.token_ids
            for m in METHODS}
    same_all += all(same.values())
    print(len(ref.token_ids), same, flush=True)
print(f"every method = exact autoregressive on {same_all}/{len(he) + len(mt)} prompts")
