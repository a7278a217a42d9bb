"""The draft model's context window (`--draft-window`) against acceptance and speed on long prompts.

For each long prompt (rows of scripts/longprompt_devset.py, the first N per category): plain decoding once,
then method `draft` (a chain of gamma draft tokens every step, so the draft model always runs) with the draft
seeing the whole text and windows of each size given. The draft never changes the output's law; greedy, each
output is compared with plain decoding's token for token (outside exact mode a near-tie may fall the other way
in a pass of another size). What changes is what the draft reads (method `draft` reads it with the target's
prefill: part of prefill_s and the time to the first token) and how often the target accepts its guesses. Writes
results.json and report.md to --out. Run it on a quiet machine.

    python scripts/draft_window_sweep.py --prompts DEVSET.jsonl --per-category 1 --windows 0,1024,512,256 --out DIR
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdecode import Engine
from specdecode.host import cpu_description


def rows(path: str, per_category: int) -> list[dict]:
    seen: dict[str, int] = {}
    out = []
    for r in map(json.loads, Path(path).expanduser().read_text().splitlines()):
        seen[r["category"]] = seen.get(r["category"], 0) + 1
        if seen[r["category"]] <= per_category:
            out.append(r)
    return out


def run(engine, prompt, method, new, gamma):
    t = time.perf_counter()
    g = engine.generate(prompt, method=method, max_new_tokens=new, gamma=gamma)
    s = g.stats
    return g.token_ids, {
        "wall_s": time.perf_counter() - t,
        "ttft_s": s.ttft_s,
        "prefill_s": s.prefill_s,
        "decode_tok_s": s.decode_tokens_per_second,
        "new_tokens": s.new_tokens,
        "draft_s": s.draft_s,
        "verify_s": s.verify_s,
        "prompt_tokens": s.prompt_tokens,
        "acceptance": s.acceptance_rate,
        "tau": s.mean_accepted_tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True, help="a long-prompt dev set (scripts/longprompt_devset.py)")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--windows", default="0,1024,512,256", help="comma-separated; 0 = the whole text")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="bench-out/draft-window")
    a = ap.parse_args()
    windows = [int(w) for w in a.windows.split(",")]
    engine = Engine.load(progress=False)
    if engine.draft_model is None:
        raise SystemExit("the sweep needs a draft model")
    for w in windows:  # out of the timed runs: first calls pay for allocations
        engine.draft_model.window = w or None
        engine.generate("def f(x):", method="draft", max_new_tokens=8)
    results = []
    for r in rows(a.prompts, a.per_category):
        prompt = [{"role": "user", "content": r["turns"][0]}]
        ref, plain = run(engine, prompt, "autoregressive", a.max_new_tokens, a.gamma)
        row = {
            "id": r["question_id"],
            "category": r["category"],
            "prompt_tokens": plain["prompt_tokens"],
            "autoregressive": plain,
            "draft": {},
        }
        for w in windows:
            engine.draft_model.window = w or None
            ids, st = run(engine, prompt, "draft", a.max_new_tokens, a.gamma)
            st["same_as_plain"] = ids == ref
            row["draft"][str(w)] = st
        results.append(row)
        print(
            row["id"],
            row["prompt_tokens"],
            {
                w: (round(s["wall_s"], 1), round(s["acceptance"] or 0, 3), s["same_as_plain"])
                for w, s in row["draft"].items()
            },
            "plain",
            round(plain["wall_s"], 1),
            flush=True,
        )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "cpu": cpu_description(),
        "target": engine.target.name,
        "draft": engine.draft_model.lm.name,
        "gamma": a.gamma,
        "max_new_tokens": a.max_new_tokens,
        "rows": results,
    }
    (out / "results.json").write_text(json.dumps(report, indent=1))
    lines = [
        "# The draft model's window on long prompts (method `draft`)\n",
        f"{report['cpu']}\n",
        f"Target {report['target']}, draft {report['draft']}, gamma {a.gamma}, {a.max_new_tokens} new tokens, "
        "greedy. Sums over the prompts; speed against plain decoding in the same run.\n",
        "| window | acceptance | τ | prefill s (target + draft) | draft s | verify s | wall s | "
        "overall vs plain | decode tok/s | decode vs plain | output = plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    tot = lambda key, get: sum(get(x)[key] or 0 for x in results)  # noqa: E731
    plain_wall = tot("wall_s", lambda x: x["autoregressive"])
    plain_dec = sum(x["autoregressive"]["decode_tok_s"] for x in results) / len(results)
    plain_prefill = tot("prefill_s", lambda x: x["autoregressive"])
    lines.append(
        f"| plain | – | 1.00 | {plain_prefill:.1f} | – | – | {plain_wall:.1f} | 1.00x | {plain_dec:.2f} | 1.00x | – |"
    )
    for w in windows:
        g = lambda x: x["draft"][str(w)]  # noqa: E731
        acc = sum(g(x)["acceptance"] or 0 for x in results) / len(results)
        tau = sum(g(x)["tau"] or 0 for x in results) / len(results)
        dec = sum(g(x)["decode_tok_s"] for x in results) / len(results)
        same = sum(g(x)["same_as_plain"] for x in results)
        lines.append(
            f"| {w or 'whole text'} | {acc:.3f} | {tau:.2f} | {tot('prefill_s', g):.1f} | "
            f"{tot('draft_s', g):.1f} | {tot('verify_s', g):.1f} | {tot('wall_s', g):.1f} | "
            f"{plain_wall / tot('wall_s', g):.2f}x | {dec:.2f} | {dec / plain_dec:.2f}x | "
            f"{same}/{len(results)} |"
        )
    lines.append(
        "\nPer prompt: results.json. Acceptance and τ: means over prompts; decode tok/s: mean of the prompts' "
        "tokens after the first / seconds after it. Prompts: licences per row of the dev set."
    )
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
