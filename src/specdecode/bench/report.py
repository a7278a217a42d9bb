"""A bench run's results as files: results.json, report.md (tables) and two plots."""

from __future__ import annotations

import json
from pathlib import Path

from .bound import COPIED


def write_outputs(results: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report(results))
    plot_speedup(results, out / "speedup.png")
    plot_acceptance(results, out / "acceptance.png")
    return out


def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


_SPEED_HEAD = (
    "TTFT s | decode tok/s | overall tok/s | decode speedup | overall speedup | vs llama.cpp overall | "
    "vs llama.cpp decode"
)


def _speed_cells(r: dict) -> str:
    """The cells of _SPEED_HEAD for a method's (or a category's) speeds."""
    vs = r.get("vs_llama_cpp") or {}
    return (
        f"{_f(r.get('ttft_s'), '{:.3f}')} | {_f(r.get('decode_tokens_per_second'))} | "
        f"{_f(r.get('tokens_per_second'))} | {_f(r.get('decode_speedup'), '{:.2f}x')} | "
        f"{_f(r.get('speedup'), '{:.2f}x')} | {_f(vs.get('overall'), '{:.2f}x')} | "
        f"{_f(vs.get('decode'), '{:.2f}x')}"
    )


def report(results: dict) -> str:
    """report.md: the main table, then a section per aspect (each empty where the run has nothing for it)."""
    lines: list[str] = []
    for section in (
        _head,
        _speeds,
        _speedup_by_category,
        _drafters,
        _engines,
        _turns,
        _pass_costs,
        _auto,
        _copies,
        _tree,
        _per_prompt,
    ):
        lines += section(results)
    return "\n".join(lines) + "\n"


def _head(results: dict) -> list[str]:
    """The run's settings and the main table: speed, τ, acceptance, the bounds."""
    cfg = results["config"]
    lines = [
        "# specdecode bench\n",
        f"{cfg['prompts']} prompts, max_new_tokens={cfg['max_new_tokens']}, gamma={cfg['gamma']}, "
        f"temperature={cfg['temperature']}, {cfg.get('backend', 'torch')} backend on {cfg['device']}: target "
        f"{cfg.get('target', '?')} ({cfg['dtype']}), draft {cfg.get('draft') or '–'} "
        f"({cfg.get('draft_dtype') or '–'}), "
        f"{cfg.get('threads', cfg['torch_threads'])} threads\n",
        f"CPU: {cfg.get('cpu', 'n/a')}\n",
        *([f"Memory: {cfg['memory']}\n"] if cfg.get("memory") else []),
        *(
            [
                f"Lookup sources: datastore {cfg['datastore']} ({cfg['datastore_tokens']:,} tokens)"
                + (f"; history {cfg['history_tokens']:,} tokens per method" if cfg.get("history_tokens") else "")
                + "\n"
            ]
            if cfg.get("datastore")
            else [f"Lookup sources: history {cfg['history_tokens']:,} tokens per method\n"]
            if cfg.get("history_tokens")
            else []
        ),
        *([f"Draft output layer: {cfg['draft_vocab']:,} rows (FR-Spec)\n"] if cfg.get("draft_vocab") else []),
        *(
            [
                f"Reused runs: {reused} (a peer on a prompt it had answered in this run, sent again with another "
                "prediction, which peers do not read: each counts with the first run's answer and seconds)\n"
            ]
            if (reused := sum(bool(r.get("reused")) for r in results.get("prompts", [])))
            else []
        ),
        "| method | tok/s | speedup vs autoregressive | tokens per target pass (τ) | acceptance rate | α | "
        "draft cost c | verify cost v | Leviathan bound | efficiency | bound with measured v | greedy agreement |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, r in results["methods"].items():
        lines.append(
            f"| {m} | {_f(r['tokens_per_second'])} | {_f(r['speedup'], '{:.2f}x')} | "
            f"{_f(r['mean_accepted_tokens'])} | {_f(r['acceptance_rate'], '{:.1%}')} | {_f(r['alpha'])} | "
            f"{_f(r['draft_cost_ratio'], '{:.3f}')} | {_f(r['verify_cost_ratio'])} | "
            f"{_f(r['analytic_bound'], '{:.2f}x')} | {_f(r['efficiency'], '{:.0%}')} | "
            f"{_f(r.get('cost_model_bound'), '{:.2f}x')} | {_f(r['greedy_agreement'], '{:.0%}')} |"
        )
    return lines


def _speeds(results: dict) -> list[str]:
    """Prefill and decoding: TTFT, decode and overall speed (by category too)."""
    cats = sorted({c for r in results["methods"].values() for c in r.get("by_category", {})})
    lines: list[str] = []
    lines += [
        "\n## Prefill and decoding\n",
        "TTFT: mean seconds to the first token (the prefill included). Decode tok/s: tokens after each run's "
        "first / seconds after it. Overall tok/s: all tokens / all seconds. vs llama.cpp: against "
        "llama-cpp-python's own plain generation in the same run.\n",
        "| method | " + _SPEED_HEAD + " |",
        "|---" * 8 + "|",
    ]
    for m, r in results["methods"].items():
        lines.append(f"| {m} | {_speed_cells(r)} |")
    if cats:
        lines += [
            "\n### Prefill and decoding by category\n",
            "| category | method | " + _SPEED_HEAD + " |",
            "|---" * 9 + "|",
        ]
        for c in cats:
            for m, r in results["methods"].items():
                if c in r.get("by_category", {}):
                    lines.append(f"| {c} | {m} | {_speed_cells(r['by_category'][c])} |")
    return lines


def _speedup_by_category(results: dict) -> list[str]:
    """Speedup by category."""
    cats = sorted({c for r in results["methods"].values() for c in r.get("by_category", {})})
    lines: list[str] = []
    if cats:
        lines += ["\n## Speedup by category\n", "| method | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
        for m, r in results["methods"].items():
            bc = r.get("by_category", {})
            lines.append(f"| {m} | " + " | ".join(_f(bc.get(c, {}).get("speedup"), "{:.2f}x") for c in cats) + " |")
    return lines


def _drafters(results: dict) -> list[str]:
    """Per drafter: its cost per pass and where accepted tokens came from."""
    lines: list[str] = []
    srcs = [m for m, r in results["methods"].items() if r.get("sources") or r.get("draft_cost_per_pass") is not None]
    if srcs:
        lines += [
            "\n## Drafters: cost and where accepted tokens came from\n",
            "Draft cost per pass: the drafter's time per target pass, in plain decoding steps. Per source: "
            "tokens drafted, accepted, and the acceptance rate.\n",
            "| method | draft cost per pass | "
            + " | ".join(("draft model", "context", "history", "datastore", "prediction"))
            + " |",
            "|---" * 7 + "|",
        ]
        for m in srcs:
            r = results["methods"][m]
            cells = []
            for src in ("draft", "context", "history", "datastore", "prediction"):
                d = (r.get("sources") or {}).get(src)
                cells.append("–" if not d else f"{d['accepted']}/{d['drafted']} ({_f(d['acceptance_rate'], '{:.0%}')})")
            lines.append(f"| {m} | {_f(r.get('draft_cost_per_pass'), '{:.3f}')} | " + " | ".join(cells) + " |")
    return lines


def _engines(results: dict) -> list[str]:
    """With --route: the engine each method's prompts ran on."""
    rows = [(m, r["engines"]) for m, r in results["methods"].items() if r.get("engines")]
    if not rows:
        return []
    return [
        "\n## Engines (--route: each prompt on the engine its measured costs predict faster)\n",
        "| method | prompts per engine |",
        "|---|---|",
    ] + [f"| {m} | " + ", ".join(f"{e} {n}" for e, n in d.items()) + " |" for m, d in rows]


def _turns(results: dict) -> list[str]:
    """By turn, for conversations."""
    lines: list[str] = []
    turns = sorted({t for r in results["methods"].values() for t in r.get("by_turn", {})})
    if turns:
        lines += [
            "\n## By turn (each conversation goes on after the method's own earlier answers)\n",
            "| method | " + " | ".join(f"turn {t}: tok/s | turn {t}: tokens per pass" for t in turns) + " |",
            "|---" * (2 * len(turns) + 1) + "|",
        ]
        for m, r in results["methods"].items():
            bt = r.get("by_turn", {})
            cells = (
                f"{_f(bt.get(t, {}).get('tokens_per_second'))} | {_f(bt.get(t, {}).get('mean_accepted_tokens'))}"
                for t in turns
            )
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def _pass_costs(results: dict) -> list[str]:
    """The measured pass costs (the cost model) and the draft's requantization."""
    cfg = results["config"]
    lines: list[str] = []
    costs = cfg.get("pass_costs") or {}
    if costs.get("target"):
        ks = list(costs["target"])
        lines += [
            "\n## Pass costs on this machine (the cost model)\n",
            f"One target pass over k new tokens after 128 cached, relative to a 1-token pass of "
            f"{costs['target_s_1'] * 1000:.1f} ms; one draft pass over k tokens in the same unit.\n",
            "| k | " + " | ".join(str(k) for k in ks) + " |",
            "|---" * (len(ks) + 1) + "|",
            "| target T(k)/T(1) | " + " | ".join(f"{costs['target'][k]:.2f}" for k in ks) + " |",
        ]
        if costs.get("draft"):
            lines.append("| draft d(k)/T(1) | " + " | ".join(_f(costs["draft"].get(k)) for k in ks) + " |")
        dq = cfg.get("draft_quant") or {}
        if dq.get("one_token_s"):
            lines.append(
                "\nDraft requantized for speed (the target decides every token): one-token draft pass, "
                "as a share of a target pass (c): "
                + ", ".join(
                    f"{n} ({dq['file_type'].get(n, n)}) {s / costs['target_s_1']:.2f}"
                    + (" ← chosen" if n == dq["chosen"] else "")
                    for n, s in dq["one_token_s"].items()
                )
            )
    return lines


def _auto(results: dict) -> list[str]:
    """auto: steps by strategy, predicted against realised (by category too)."""
    lines: list[str] = []
    auto = results["methods"].get("auto")
    if auto and auto.get("strategies"):
        predicted = auto.get("predicted_speedup")
        ratio = auto["speedup"] / predicted if auto["speedup"] and predicted else None
        lines += [
            "\n## auto\n",
            "| steps by strategy | expected tokens per pass | realised (τ) | "
            "predicted speedup (cost model) | realised speedup | realised / predicted |",
            "|---|---|---|---|---|---|",
            f"| {', '.join(f'{k} {v}' for k, v in auto['strategies'].items())} | "
            f"{_f(auto.get('expected_tokens_per_pass'))} | {_f(auto['mean_accepted_tokens'])} | "
            f"{_f(auto.get('predicted_speedup'), '{:.2f}x')} | {_f(auto['speedup'], '{:.2f}x')} | "
            f"{_f(ratio, '{:.0%}')} |",
        ]
        bc = {c: v for c, v in auto.get("by_category", {}).items() if "predicted_speedup" in v}
        if bc:
            lines += [
                "\n### auto by category: predicted against realised\n",
                "Predicted: the cost model's expected tokens per modelled second of the passes it planned, "
                "in plain steps (decoding only: no prefill). Realised: against our autoregressive in the "
                "same run, in decode tok/s (after the first token) and overall.\n",
                "| category | steps by strategy | expected tokens per pass | realised (τ) | predicted speedup | "
                "realised decode speedup | realised overall speedup | realised decode / predicted |",
                "|---" * 8 + "|",
            ]
            for c, v in bc.items():
                pred, dec = v.get("predicted_speedup"), v.get("decode_speedup")
                steps = ", ".join(f"{k} {n}" for k, n in (v.get("strategies") or {}).items()) or "–"
                lines.append(
                    f"| {c} | {steps} | "
                    f"{_f(v.get('expected_tokens_per_pass'))} | {_f(v.get('mean_accepted_tokens'))} | "
                    f"{_f(pred, '{:.2f}x')} | {_f(dec, '{:.2f}x')} | {_f(v.get('speedup'), '{:.2f}x')} | "
                    f"{_f(dec / pred if dec and pred else None, '{:.0%}')} |"
                )
    return lines


def _copies(results: dict) -> list[str]:
    """Each answer with a prediction: the share of it that copies the prediction and its decoding against the
    perfect-copy bound on this machine's measured pass costs, the same copy timed in this run, and the plan that knows
    the edit points (bench/bound.py)."""
    rows = [r for r in results["prompts"] if r.get("copy_bound_tokens_per_second")]
    if not rows:
        return []
    lines = [
        "\n## Copies against their bound\n",
        "Bound: a copy that is always right, each token in the timed pass size that costs least per token at its "
        "context (max over k of k / T(k) on the cost table). Timed: that perfect copy run on the target in this run, "
        "after the answer (its passes verify the answer's own tokens), for the answers that copy "
        f"≥ {COPIED:.0%} of their tokens from the prediction (longest common subsequence; marked ✓). Oracle: the best "
        "plan on the cost table that knows in advance where the answer leaves the prediction; no drafter that learns "
        "an edit point when the target writes it can beat it.\n",
        "| prompt | method | copied | decode tok/s | bound tok/s | timed bound tok/s | oracle tok/s "
        "| of the bound | of the timed bound | oracle of the bound |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    marked = []
    for r in rows:
        share, bound, dec = r.get("prediction_copied"), r["copy_bound_tokens_per_second"], r["decode_tokens_per_second"]
        timed, oracle = r.get("timed_copy_bound_tokens_per_second"), r.get("oracle_tokens_per_second")
        frac = dec / bound if dec and bound else None
        of_timed = dec / timed if dec and timed else None
        if share is not None and share >= COPIED and frac is not None:
            marked.append((frac, of_timed))
        mark = " ✓" if share is not None and share >= COPIED else ""
        lines.append(
            f"| {r['prompt_id']} | {r['method']} | {_f(share, '{:.1%}')}{mark} | {_f(dec)} | {_f(bound)} | "
            f"{_f(timed)} | {_f(oracle)} | {_f(frac, '{:.2f}')} | {_f(of_timed, '{:.2f}')} | "
            f"{_f(oracle / bound if oracle and bound else None, '{:.2f}')} |"
        )
    if marked:
        fracs = [f for f, _ in marked]
        timed = [t for _, t in marked if t is not None]
        lines.append(
            f"\nOn the {len(marked)} answers marked: {sum(fracs) / len(fracs):.2f} of the bound on average "
            f"(lowest {min(fracs):.2f})"
            + (f"; {sum(timed) / len(timed):.2f} of the timed bound (lowest {min(timed):.2f})." if timed else ".")
        )
    return lines


def _tree(results: dict) -> list[str]:
    """The tree method's shape and costs."""
    cfg = results["config"]
    lines: list[str] = []
    tree = results["methods"].get("tree")
    if tree and tree.get("nodes_per_pass") is not None:
        costs = cfg.get("pass_costs") or {}
        lines += [
            "\n## Token tree\n",
            f"shape fixed by hand: {cfg.get('tree') or 'none (cost model)'}\n",
            "| nodes per pass | depth per pass | expected tokens per pass | realised (τ) | "
            "draft time per pass / plain step | verify cost v |",
            "|---|---|---|---|---|---|",
            f"| {_f(tree['nodes_per_pass'])} | {_f(tree['depth_per_pass'])} | "
            f"{_f(tree['expected_tokens_per_pass'])} | {_f(tree['mean_accepted_tokens'])} | "
            f"{_f(tree.get('draft_cost_per_pass'))} | {_f(tree['verify_cost_ratio'])} |",
        ]
        if costs.get("target"):
            lines.append(
                "\nMeasured pass costs (cost model, relative to a 1-token target pass of "
                f"{costs['target_s_1'] * 1000:.0f} ms): target "
                + ", ".join(f"{n} tok {r:.2f}" for n, r in costs["target"].items())
                + "; draft "
                + ", ".join(f"{n} tok {r:.2f}" for n, r in costs["draft"].items())
            )
    return lines


def _per_prompt(results: dict) -> list[str]:
    """Per prompt, and what the columns mean."""
    lines: list[str] = []
    lines += [
        "\n## Per prompt\n",
        "| prompt | method | tok/s | TTFT s | decode tok/s | new tokens | τ | acceptance |",
        "|---" * 8 + "|",
    ]
    for r in results["prompts"]:
        lines.append(
            f"| {r['prompt_id']} | {r['method']} | {_f(r['tokens_per_second'])} | "
            f"{_f(r.get('ttft_s'), '{:.3f}')} | {_f(r.get('decode_tokens_per_second'))} | {r['new_tokens']} | "
            f"{_f(r['mean_accepted_tokens'])} | {_f(r['acceptance_rate'], '{:.1%}')} |"
        )
    lines.append(
        "\nα: per-token acceptance, accepted / (accepted + rejections). c: mean time of one draft "
        "forward / one plain target forward. Bound: Leviathan et al. 2023, Thm 3.8, "
        "(1 − α^(γ+1)) / ((1 − α)(γc + 1)), which assumes a (γ+1)-token target pass costs what a "
        "1-token pass does. v: mean verify pass time / one plain target forward; 'bound with measured v' "
        "is the same expectation divided by (γc + v) instead of (γc + 1)."
    )
    return lines


def plot_speedup(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(results["methods"])
    cats = sorted({c for r in results["methods"].values() for c in r.get("by_category", {})})
    groups = ["all prompts"] + cats
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups) * len(methods) / 2), 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        r = results["methods"][m]
        vals = [r["speedup"] or 0] + [(r.get("by_category", {}).get(c, {}).get("speedup") or 0) for c in cats]
        bars = ax.bar([g + i * width for g in range(len(groups))], vals, width, label=m)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks([g + width * (len(methods) - 1) / 2 for g in range(len(groups))], groups, rotation=20 if cats else 0)
    ax.set_ylabel("speedup vs autoregressive (×, tokens/s ratio)")
    cfg = results["config"]
    ax.set_title(
        f"Speedup, {cfg['prompts']} prompts, {cfg['max_new_tokens']} new tokens, γ={cfg['gamma']}, "
        f"T={cfg['temperature']}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, r in results["methods"].items():
        acc = r.get("acceptance_by_position")
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=m)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position (1 = first drafted token)")
    ax.set_ylabel("share of drafted tokens accepted")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance by draft position")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
