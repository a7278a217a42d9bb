"""Exact greedy mode on the default pair: is every method's output plain decoding's, token for token, and what
does exactness cost?

For each prompt (HumanEval's first N completions, MIT; MT-bench's first M questions as chat, Apache-2.0):
- exact mode (flash attention on, the measured exact pass sizes): autoregressive, then every method; each
  output compared with exact autoregressive's, token for token;
- the peer, compared with exact autoregressive's: on llama.cpp, llama-cpp-python's own greedy generation of
  the same GGUF with flash attention on (same settings); on torch (--backend torch --dtype bf16),
  transformers' own `generate(do_sample=False)` on the same weights;
- default mode: autoregressive and auto, for the cost of exactness (wall seconds, summed over prompts).
Writes results.json and report.md to --out. Run it on a quiet machine.

    python scripts/exact_bench.py --humaneval 20 --mtbench 10 --out exact-out
    python scripts/exact_bench.py --backend torch --dtype bf16 --humaneval 20 --mtbench 10 --out ...
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdecode import Engine
from specdecode.host import cpu_description

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
EXACT_METHODS = ["auto", "draft", "pld", "tree", "lookup"]


def prompts(n_he: int, n_mt: int, long_path: str | None = None, n_long: int = 0) -> list[tuple[str, object]]:
    he = [json.loads(x) for x in (DATA / "humaneval.jsonl").read_text().splitlines()[:n_he]]
    mt = [json.loads(x) for x in (DATA / "mt_bench.jsonl").read_text().splitlines()[:n_mt]]
    chats = [("mt_bench", [{"role": "user", "content": r["turns"][0]}]) for r in mt]
    out, step = [], max(1, round(len(he) / max(1, len(chats))))  # interleaved: a cut-off run holds both kinds
    for i, r in enumerate(he):
        out.append(("humaneval", r["prompt"]))
        if (i + 1) % step == 0 and chats:
            out.append(chats.pop(0))
    out += chats
    if long_path:  # scripts/longprompt_devset.py's rows: the first n_long of each category
        seen: dict[str, int] = {}
        for r in map(json.loads, Path(long_path).expanduser().read_text().splitlines()):
            seen[r["category"]] = seen.get(r["category"], 0) + 1
            if seen[r["category"]] <= n_long:
                out.append((r["category"], [{"role": "user", "content": r["turns"][0]}]))
    return out


def timed(engine, prompt, method, new):
    t = time.perf_counter()
    out = engine.generate(prompt, method=method, max_new_tokens=new)
    return out, time.perf_counter() - t


def peer_ids(llm, ids, n, eos):
    llm.reset()
    got = []
    for t in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        got.append(t)
        if len(got) >= n or t in eos:
            break
    return got


def hf_peer_ids(model, ids, n, eos):
    """transformers' own greedy generation on the torch target's weights (its own KV cache and kernels)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            top_k=None,
            top_p=None,
            temperature=None,
            pad_token_id=min(eos),
            eos_token_id=sorted(eos),
        )
    return [int(t) for t in out[0, len(ids) :]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--humaneval", type=int, default=20)
    ap.add_argument("--mtbench", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="bench-out/exact")
    ap.add_argument("--longprompt", default=None, help="a long-prompt dev set (scripts/longprompt_devset.py)")
    ap.add_argument("--long", type=int, default=0, help="prompts per category of --longprompt")
    ap.add_argument("--methods", default=",".join(EXACT_METHODS), help="methods run in exact mode")
    ap.add_argument("--backend", default="auto", choices=["auto", "llama.cpp", "torch"])
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp32", "fp16"], help="torch: the weights' type")
    ap.add_argument("--target", default=None, help="default: the default pair")
    ap.add_argument(
        "--resume",
        default=None,
        help="a results.json of an earlier run cut off: its rows are kept and its prompts skipped",
    )
    ap.add_argument("--draft", default=None)
    a = ap.parse_args()
    load = dict(target=a.target, draft=a.draft, progress=False, backend=a.backend, dtype=a.dtype)
    exact = Engine.load(exact=True, **load)
    default = Engine.load(**load)
    limits = exact.exact_limits()
    if exact.backend == "llama.cpp":
        from llama_cpp import Llama

        llm = Llama(
            str(exact.target.gguf_path),
            n_ctx=4096,
            n_threads=exact.target.threads,
            n_threads_batch=exact.target.threads,
            n_batch=512,
            n_ubatch=512,
            flash_attn=True,
            verbose=False,
        )
        peer, peer_name = (lambda ids, n: peer_ids(llm, ids, n, exact.eos_ids)), "llama-cpp-python (FA on)"
    else:
        peer_name = "transformers generate"
        peer = lambda ids, n: hf_peer_ids(exact.target.model, ids, n, exact.eos_ids)  # noqa: E731
    rows = json.loads(Path(a.resume).read_text())["rows"] if a.resume else []
    methods = a.methods.split(",")
    for engine, ms in ((exact, ["autoregressive", *methods]), (default, ["autoregressive", "auto"])):
        for m in ms:  # one-time measurements (pass costs, exact pass sizes) out of the timed runs
            engine.generate("def f(x):", method=m, max_new_tokens=8)
    for cat, prompt in prompts(a.humaneval, a.mtbench, a.longprompt, a.long)[len(rows) :]:
        ids = exact.encode(prompt)
        r = {"category": cat, "prompt_tokens": len(ids), "wall": {}, "tokens": {}, "tau": {}, "same": {}}
        ref, r["wall"]["exact/autoregressive"] = timed(exact, prompt, "autoregressive", a.max_new_tokens)
        r["tokens"]["exact/autoregressive"] = len(ref.token_ids)
        theirs = peer(ids, len(ref.token_ids))
        r["same"]["peer"] = theirs == ref.token_ids
        for m in methods:
            out, r["wall"][f"exact/{m}"] = timed(exact, prompt, m, a.max_new_tokens)
            r["same"][m] = out.token_ids == ref.token_ids
            r["tau"][f"exact/{m}"] = out.stats.mean_accepted_tokens
        for m in ("autoregressive", "auto"):
            out, r["wall"][f"default/{m}"] = timed(default, prompt, m, a.max_new_tokens)
            r["tokens"][f"default/{m}"] = len(out.token_ids)
            r["tau"][f"default/{m}"] = out.stats.mean_accepted_tokens
        rows.append(r)
        print(cat, len(ids), r["same"], {k: round(v, 2) for k, v in r["wall"].items()}, flush=True)
        write(Path(a.out), exact, limits, peer_name, methods, a.max_new_tokens, rows)  # after every prompt: a cut-off
    print((Path(a.out) / "report.md").read_text())  # run keeps what it had


def write(out: Path, exact, limits, peer_name: str, methods: list[str], max_new_tokens: int, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "cpu": cpu_description(),
        "backend": exact.backend,
        "target": exact.target.name,
        "dtype": str(exact.target.dtype),
        "peer": peer_name,
        "limits": limits.__dict__,
        "max_new_tokens": max_new_tokens,
        "rows": rows,
    }
    (out / "results.json").write_text(json.dumps(report, indent=1))
    lines = [
        "# Exact greedy mode on the default pair\n",
        f"{report['cpu']}\n",
        f"Measured exact pass sizes: up to {limits.max_pass} tokens, trees {'yes' if limits.trees else 'no'}.\n",
        f"Methods in exact mode: {', '.join(methods)}.\n",
        f"Backend: {exact.backend}, target {exact.target.name} ({exact.target.dtype}).\n",
        f"| category | prompts | all methods = exact autoregressive | exact AR = {peer_name} | "
        "exact AR / default AR (time) | exact auto / default auto | exact auto / default AR | τ exact auto | "
        "τ default auto | median per prompt: exact AR / default AR, exact auto / default auto |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cat in sorted({r["category"] for r in rows}):
        rs = [r for r in rows if r["category"] == cat]
        w = lambda k: sum(r["wall"][k] for r in rs)  # noqa: E731
        med = lambda a, b: sorted(r["wall"][a] / r["wall"][b] for r in rs)[len(rs) // 2]  # noqa: E731
        tau = lambda k: sum(r["tau"][k] for r in rs) / len(rs)  # noqa: E731
        same = sum(all(r["same"][m] for m in methods) for r in rs)
        peer_same = sum(r["same"]["peer"] for r in rs)
        lines.append(
            f"| {cat} | {len(rs)} | {same}/{len(rs)} | {peer_same}/{len(rs)} | "
            f"{w('exact/autoregressive') / w('default/autoregressive'):.3f} | "
            f"{w('exact/auto') / w('default/auto'):.3f} | "
            f"{w('exact/auto') / w('default/autoregressive'):.3f} | "
            f"{tau('exact/auto'):.2f} | {tau('default/auto'):.2f} | "
            f"{med('exact/autoregressive', 'default/autoregressive'):.3f}, "
            f"{med('exact/auto', 'default/auto'):.3f} |"
        )
    lines.append(
        "\nRatios are wall-time ratios summed over the category's prompts (>1: exact mode is slower). "
        "HumanEval: MIT; MT-bench questions: Apache-2.0."
    )
    (out / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
