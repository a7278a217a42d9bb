"""Greedy token ids of every method on the first 10 HumanEval prompts (completions) and the first 5 MT-bench
questions (chats), 48 new tokens, on the default pair: one JSON {method: {"tokens": [...], "tok_s": x}}. Run it on two
codes (PYTHONPATH=<worktree>/src) and compare the files: the check behind "The floor plan kept the behaviour"
(docs/design/architecture.md).

    python scripts/greedy_outputs.py OUT.json [DATA_DIR]   (DATA_DIR: humaneval.jsonl and mt_bench.jsonl)
"""

import json
import sys
import time
from pathlib import Path

from specdecode import Engine

METHODS = ("autoregressive", "auto", "draft", "pld", "lookup", "tree")


def main(out_path: str, data: str = "../shared/data") -> None:
    he = [json.loads(line)["prompt"] for line in open(Path(data) / "humaneval.jsonl")][:10]
    mt = [json.loads(line)["turns"][0] for line in open(Path(data) / "mt_bench.jsonl")][:5]
    engine = Engine.load(progress=False)
    res = {}
    for method in METHODS:
        tokens, n, t0 = [], 0, time.perf_counter()
        for i, prompt in enumerate(he + mt):
            chat = i >= len(he)
            r = engine.generate(
                [{"role": "user", "content": prompt}] if chat else prompt,
                method=method,
                max_new_tokens=48,
                temperature=0.0,
                chat=chat,
            )
            tokens.append(r.token_ids)
            n += len(r.token_ids)
        res[method] = {"tokens": tokens, "tok_s": n / (time.perf_counter() - t0)}
        print(method, round(res[method]["tok_s"], 2), flush=True)
    Path(out_path).write_text(json.dumps(res))


if __name__ == "__main__":
    main(*sys.argv[1:])
