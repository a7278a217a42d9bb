#!/usr/bin/env bash
# The run behind docs/results/ray: the default pair served as 2 Ray Serve replicas x 1 thread, as 1 replica x 2
# threads, and by plain `specdecode serve --threads 2` (no Ray: what Ray itself costs), each under the same
# closed-loop load of `specdecode loadtest` at concurrency 4 (1 runs first: the greedy reference). One server at a
# time, on a quiet machine (it uses every core). Needs the ray, server and models extras.
#
#   bash scripts/ray_compare.sh                     # PROMPTS=FILE LIMIT=N MAX_TOKENS=N OUT=DIR PORT=N override
#
# Writes $OUT/<config>/loadtest.{json,md,png} and $OUT/summary.md: total completion tokens/s, request latency
# (e2e) p50/p99 and TTFT p99 at concurrency 4, side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${PROMPTS:-/work/shared/data/humaneval.jsonl}
LIMIT=${LIMIT:-16}
MAX_TOKENS=${MAX_TOKENS:-128}
OUT=${OUT:-ray-out}
PORT=${PORT:-8000}
mkdir -p "$OUT"

measure() {  # measure NAME SERVE-ARGS...: start the server, wait until it serves, load it, stop it
    local name=$1 log="$OUT/$1.serve.log"
    shift
    specdecode serve --port "$PORT" "$@" >"$log" 2>&1 &
    local pid=$!
    trap 'kill -INT $pid 2>/dev/null || true' EXIT
    until grep -q "specdecode: serving" "$log"; do  # printed once every replica has loaded and measured
        kill -0 "$pid" 2>/dev/null || { echo "$name: the server exited:"; tail -20 "$log"; exit 1; }
        sleep 2
    done
    until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do sleep 1; done
    specdecode loadtest --server "$name=http://127.0.0.1:$PORT" --prompts "$PROMPTS" --limit "$LIMIT" \
        --concurrency 4 --max-tokens "$MAX_TOKENS" --out "$OUT/$name"
    kill -INT "$pid"
    wait "$pid" || true
    trap - EXIT
}

measure ray-2x1 --ray --replicas 2 --threads 1
measure ray-1x2 --ray --replicas 1 --threads 2
measure plain-2 --threads 2

python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = ["| server | concurrency | ok/requests | completion tok/s | e2e p50 (s) | e2e p99 (s) | TTFT p99 (s) | errors |",
        "|---|---|---|---|---|---|---|---|"]
for name in ("ray-2x1", "ray-1x2", "plain-2"):
    result = json.loads((out / name / "loadtest.json").read_text())
    for s in result["servers"][name]["levels"]:
        if "failed" in s:
            rows.append(f"| {name} | {s['concurrency']} | failed | | | | | |")
            continue
        f = lambda x: "n/a" if x is None else f"{x:.2f}"
        rows.append(f"| {name} | {s['concurrency']} | {s['ok']}/{s['requests']} | {f(s['tokens_per_s'])} | "
                    f"{f(s['e2e_p50_s'])} | {f(s['e2e_p99_s'])} | {f(s['ttft_p99_s'])} | {s['errors']} |")
(out / "summary.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
EOF
