#!/usr/bin/env python3
"""Replay the copy drafter's plan on recorded greedy answers, priced on a measured pass-cost table: the modelled decode
time of `auto`'s lookup and copy steps (no draft model), free of the machine's noise, to compare policies offline.

Each answer of `auto` in a bench's results.json is replayed step by step: the drafter proposes from the prompt and
the prediction (as the engine builds them), the known answer stands in for the target's greedy verdict, and each pass
is priced T(k) at its context from the cost table. Prints, per task, the passes, the modelled speed-up over plain
decoding, the share of the perfect-copy bound and of the plan that knows the edit points (bench/bound.py), and the
realised decode speed; -v prints the steps (c: copy, l: lookup, p: plain; drafted/accepted). The copy constants can
be set for a trial: --set NEAR=12.

    python scripts/replay_copies.py out/results.json edits.jsonl ~/.cache/specdecode/costs/<key>.json \\
        --tokenizer ~/.cache/specdecode/tokenizers/<target>
"""

from __future__ import annotations

import argparse
import json
import math

from transformers import AutoTokenizer

from specdecode.bench.bound import copy_bound, oracle_bound
from specdecode.drafters import copy as copy_module
from specdecode.drafters.copy import followed
from specdecode.drafters.lookup import Lookup
from specdecode.planning.costs import CostModel
from specdecode.planning.planner import TreeState
from specdecode.planning.tree import TreeDrafter
from specdecode.sampling import SamplingParams


def cost_table(path: str) -> CostModel:
    raw = json.load(open(path))
    longer = {int(c): {int(k): v for k, v in t.items()} for c, t in raw.get("target_at", {}).items()}
    return CostModel({int(k): v for k, v in raw["target"].items()}, {}, longer, {})


def replay(prompt_ids: list[int], prediction_ids, answer: list[int], costs: CostModel):
    """(modelled seconds, steps) of the answer after its first token, as the auto drafter without a model plans it."""
    state = TreeState()
    state.measure = True
    drafter = TreeDrafter(
        None,
        pld=True,
        costs=costs,
        state=state,
        lazy=True,
        remaining=len(answer),
        lookup=Lookup(None, None, copies=followed(prompt_ids, prediction_ids)),
    )
    drafter.prefill(prompt_ids)
    ids, n, seconds, steps = list(prompt_ids) + answer[:1], 1, 0.0, []
    while n < len(answer):
        room = len(answer) - n - 1
        draft = drafter.propose(ids, room, SamplingParams()) if room > 0 else None
        tokens, parents = (draft.tokens, draft.tree_parents) if draft else ([], [])
        path, at = [], -1  # the greedy verdict: the tree's path along the known answer
        while n + len(path) < len(answer):
            nxt = [i for i, (t, p) in enumerate(zip(tokens, parents)) if p == at and t == answer[n + len(path)]]
            if not nxt:
                break
            at = nxt[0]
            path.append(at)
        bonus = answer[n + len(path)] if n + len(path) < len(answer) else answer[-1]
        seconds += costs.t(len(tokens) + 1, len(ids))
        if draft:
            drafter.commit(len(ids), path, bonus)
        steps.append(f"{((draft.strategy if draft else None) or 'plain')[0]}{len(tokens)}/{len(path)}")
        new = [tokens[i] for i in path] + [bonus]
        ids += new
        n += len(new)
    return seconds, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results")
    ap.add_argument("prompts")
    ap.add_argument("costs")
    ap.add_argument("--tokenizer", required=True, help="the target's tokenizer folder (with its chat template)")
    ap.add_argument("--only", default="", help="comma-separated task ids")
    ap.add_argument("--set", action="append", default=[], help="NAME=VALUE: a constant of drafters/copy.py")
    ap.add_argument("-v", action="store_true")
    args = ap.parse_args()
    for item in args.set:
        name, value = item.split("=", 1)
        setattr(copy_module, name, type(getattr(copy_module, name))(json.loads(value)))
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    costs = cost_table(args.costs)
    tasks = {t["question_id"]: t for t in map(json.loads, open(args.prompts))}
    only = set(filter(None, args.only.split(",")))
    logs = []
    for r in json.load(open(args.results))["prompts"]:
        t = tasks.get(r["prompt_id"])
        if r["method"] != "auto" or t is None or only and r["prompt_id"] not in only:
            continue
        answer = json.loads(r["token_ids"]) if isinstance(r["token_ids"], str) else r["token_ids"]
        prompt = tok.apply_chat_template([{"role": "user", "content": t["turns"][0]}], add_generation_prompt=True)
        prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt  # transformers 5 returns a mapping
        prediction = tok.encode(t["prediction"]) if t.get("prediction") else None
        seconds, steps = replay(list(prompt), prediction, answer, costs)
        plain = sum(costs.t(1, len(prompt) + i) for i in range(1, len(answer)))
        bound = copy_bound(costs, len(prompt), len(answer))
        oracle = oracle_bound(costs, len(prompt), answer, list(prediction or ()))
        rate = (len(answer) - 1) / seconds
        logs.append(math.log(plain / seconds))
        realised = r["decode_tokens_per_second"]
        print(
            f"{r['prompt_id']:20s} new {len(answer):5d} passes {len(steps):4d} modelled {rate:6.1f} tok/s "
            f"= {plain / seconds:.2f}x plain, {rate / bound:.2f} of the bound (oracle {oracle / bound:.2f}); "
            f"realised {realised:.1f}"
        )
        if args.v:
            print("   ", " ".join(steps))
    if logs:
        mean = math.exp(sum(logs) / len(logs))
        print(f"geometric mean of the modelled speed-ups: {mean:.3f}x plain ({len(logs)} answers)")


if __name__ == "__main__":
    main()
