"""`specdecode loadtest`'s outputs: loadtest.json (everything), loadtest.md (a table per server and
concurrency, the greedy mismatches) and loadtest.png (total throughput and p99 time to first token against
concurrency, one line per server)."""

from __future__ import annotations

import json
from pathlib import Path


def _ms(x) -> str:
    return "n/a" if x is None else f"{x * 1000:.0f}" if x >= 0.1 else f"{x * 1000:.1f}"


def _rss(s: dict) -> str:
    mem = s.get("memory") or {}
    if mem.get("rss_peak_mib") is None:
        return "n/a"
    return f"{mem['rss_before_mib']:.0f} / {mem['rss_peak_mib']:.0f}"


def _other_cpu(s: dict) -> str:
    """CPU ms per completion token spent outside the decoding threads (procmem.cpu_split)."""
    cpu = s.get("cpu")
    if not cpu or not s.get("completion_tokens"):
        return "n/a"
    return f"{cpu['other_cpu_s'] * 1000 / s['completion_tokens']:.2f}"


def markdown(results: dict) -> str:
    cfg = results["config"]
    lines = [
        f"# Load test: {cfg['max_tokens']} new tokens, greedy, streamed",
        "",
        f"CPU: {results.get('cpu') or 'unknown'}; prompts: {', '.join(cfg['prompts'])} "
        f"({cfg['n_prompts']} prompts); requests per level: {cfg['requests'] or 'every prompt once'}",
        "",
        *(
            [
                f"Memory: {results['memory']} (a `specdecode serve` launched here inherits it; other servers get "
                "the environment as the user had it)",
                "",
            ]
            if results.get("memory")
            else []
        ),
        "| server | concurrency | ok/requests | total completion tok/s | TTFT p50 (ms) | TTFT p99 (ms) | "
        "ITL p50 (ms) | ITL p99 (ms) | TPOT p50 (ms) | errors (5xx) | greedy mismatches | "
        "server RSS before / peak (MiB) | other threads' CPU ms / token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, srv in results["servers"].items():
        for s in srv["levels"]:
            if "failed" in s:
                lines.append(f"| {name} | {s['concurrency']} | failed: {s['failed'][:80]!s} | | | | | | | | | | |")
                continue
            rate = "n/a" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:.2f}"
            mism = (
                f"{s['greedy_mismatches']}/{s['greedy_compared']}"
                if s["concurrency"] > 1 or s["greedy_compared"]
                else "(reference)"
            )
            level = f"{s['concurrency']}" + (f" (round {s['round']})" if s.get("round", 1) > 1 else "")
            lines.append(
                f"| {name} | {level} | {s['ok']}/{s['requests']} | {rate} | {_ms(s['ttft_p50_s'])} "
                f"| {_ms(s['ttft_p99_s'])} | {_ms(s['itl_p50_s'])} | {_ms(s['itl_p99_s'])} "
                f"| {_ms(s['tpot_p50_s'])} | {s['errors']} ({s['errors_5xx']}) | {mism} | {_rss(s)} "
                f"| {_other_cpu(s)} |"
            )
    lines += [
        "",
        "ITL: gaps between streamed text chunks (a chunk with several tokens counts once); TPOT: "
        "(last chunk - first chunk) / (tokens - 1) per request. Greedy mismatches: responses at this "
        "concurrency whose text differs from the same prompt served alone (concurrency 1; a later round at "
        "concurrency 1 is compared with the first). Server RSS: resident memory of a launched server and its "
        "child processes before the round and its peak during it (sampled every 0.5 s); n/a for servers not "
        "launched here. "
        "Other threads' CPU: CPU time of a launched server's threads other than its busiest `--threads` "
        "(the decoding threads) over the round's load, per completion token: with as many cores as "
        "decoding threads, time taken from the decoding.",
    ]
    lines += cross_server(results) + like_for_like(results)
    mismatches = [(name, m) for name, srv in results["servers"].items() for m in srv["mismatches"]]
    if mismatches:
        lines += [
            "",
            "## Greedy mismatches",
            "",
            "| server | concurrency | prompt | first differing char | solo | got |",
            "|---|---|---|---|---|---|",
        ]
        for name, m in mismatches[:50]:
            lines.append(
                f"| {name} | {m['concurrency']} | {m['id']} | {m['at_char']} | {json.dumps(m['solo'])} "
                f"| {json.dumps(m['got'])} |"
            )
    commands = [
        (name, c, cmd) for name, srv in results["servers"].items() for c, cmd in srv.get("commands", {}).items()
    ]
    if commands:
        lines += ["", "## Commands", ""] + [f"- {name}, concurrency {c}: `{cmd}`" for name, c, cmd in commands]
    return "\n".join(lines) + "\n"


def cross_server(results: dict) -> list[str]:
    """How many solo (concurrency 1) answers of each server equal the first server's, prompt by prompt."""
    named = [(name, srv.get("solo") or {}) for name, srv in results["servers"].items()]
    if len(named) < 2 or not named[0][1]:
        return []
    first, ref = named[0]
    out = [
        "",
        f"Solo answers equal to {first}'s (greedy, same prompt): "
        + ", ".join(
            f"{name} {sum(1 for k, v in solo.items() if ref.get(k) == v)}/{sum(1 for k in solo if k in ref)}"
            for name, solo in named[1:]
        ),
    ]
    return out


def like_for_like(results: dict) -> list[str]:
    """Greedy texts differ between servers (near-ties under other pass shapes), and a text that ends early makes the
    whole level's tok/s compare different work. So, per level, over the requests (first round) that this server and
    the first one answered with the same number of tokens: the first server's summed request time over this one's
    (> 1: this one is faster)."""
    servers = list(results["servers"].items())
    if len(servers) < 2:
        return []

    def done(srv) -> dict:  # (concurrency, round, prompt, which time the prompt came in that round) -> request
        seen, out = {}, {}
        for q in srv.get("requests", []):
            k = (q["concurrency"], q.get("round", 1), q["id"])
            # a prompt sent again in a level (--requests past the prompts) is paired in order
            seen[k] = seen.get(k, -1) + 1
            if q.get("error") is None:
                out[(*k, seen[k])] = q
        return out

    first_name, first = servers[0][0], done(servers[0][1])
    out = []
    for name, srv in servers[1:]:
        mine, per_level = done(srv), {}
        for k, q in mine.items():
            ref = first.get(k)
            if k[1] == 1 and ref is not None and ref["tokens"] == q["tokens"]:
                n, a, b = per_level.get(k[0], (0, 0.0, 0.0))
                per_level[k[0]] = (n + 1, a + ref["e2e_s"], b + q["e2e_s"])
        if per_level:
            out.append(
                f"{name}, requests of the same length as {first_name}'s: "
                + ", ".join(
                    f"c = {c}: {first_name} / {name} time {a / b:.3f} over {n}"
                    for c, (n, a, b) in sorted(per_level.items())
                )
            )
    return ["", *out] if out else []


def plot(results: dict, path: Path) -> Path | None:
    """Throughput and p99 TTFT against concurrency; None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ticks = sorted({s["concurrency"] for srv in results["servers"].values() for s in srv["levels"]})
    for name, srv in results["servers"].items():
        levels = [
            s for s in srv["levels"] if "failed" not in s and s["tokens_per_s"] is not None and s.get("round", 1) == 1
        ]
        if not levels:
            continue
        cs = [s["concurrency"] for s in levels]
        ax1.plot(cs, [s["tokens_per_s"] for s in levels], marker="o", label=name)
        ax2.plot(cs, [s["ttft_p99_s"] or 0.0 for s in levels], marker="o", label=name)
    for ax, title, ylabel in (
        (ax1, "total completion throughput", "tokens / s"),
        (ax2, "time to first token, p99", "seconds"),
    ):
        ax.set_title(title)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    cpu = (results.get("cpu") or "").split(", flags")[0]
    fig.suptitle(f"{results['config']['max_tokens']} new tokens, greedy, streamed; {cpu}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(results: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loadtest.json").write_text(json.dumps(results, indent=1))
    (out / "loadtest.md").write_text(markdown(results))
    plot(results, out / "loadtest.png")
    return out
