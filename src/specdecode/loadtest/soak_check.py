"""The judgement and the report of `specdecode loadtest --soak` (soak_run.py gathers what is judged here).

Criteria (each passes, fails, or is not judged where its data is missing, with the cases that failed it):
- no_5xx: no response or stream error event of the 5xx class other than the documented 503s (queue full,
  timeout in the queue, shutting down, engine unavailable), as the clients saw them and as the server counted them;
- greedy_alone: every finished greedy answer equals the same request sent again alone to the quiet server, or parts
  from it at a near-tie of the two tokens it parts on, scored by the target alone (soak_ties.py);
- terminal_events: every stream a client read to its end ended with [DONE] after a finish_reason chunk, or with an
  error event; every JSON answer with a finish_reason;
- no_silent_loss: no request that the client did not give up on ended without a status (a transport failure),
  except connections refused while the server was down for its restart, and connections the stopping server closed
  unread (see `closed_unread`);
- restart: every request in flight or sent from the SIGTERM until the new server answered got an answer or a clear
  error (a status, then a complete answer or an error), or was refused a connection or closed unread;
- refusals: malformed and oversized requests got a 4xx;
- idle_memory: the server's RSS once idle after the load is within `drift` of its idle level before it, and its
  gauges of work in progress (queue depth, busy, any KV cells gauge) are back to their idle values;
- latency: p99 time to first token and p99 inter-token latency of the honest streamed requests during the soak
  (outside the restart) are within `latency_factor` x the quiet run's (plus `latency_floor_s`).
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

from ..server import GRACEFUL_SHUTDOWN_S
from .client import first_difference, percentile

DOCUMENTED_503 = {"queue_full", "timeout", "shutting_down", "engine_unavailable"}
RESTART_SLACK_S = 1.0  # after the new server answers /health: connections refused this long after still count as down


def error_code(rec: dict) -> str | None:
    """The `code` of the error a request got (an HTTP error body or a stream's error event), None without one."""
    err = rec.get("error") or ""
    for head in ("stream error event: ",):
        if err.startswith(head):
            try:
                return json.loads(err[len(head) :]).get("code")
            except ValueError:
                return None
    if err.startswith("HTTP "):
        try:
            return (json.loads(err.split(": ", 1)[1]).get("error") or {}).get("code")
        except (ValueError, IndexError, AttributeError):
            return None
    return None


def finished(rec: dict) -> bool:
    """An answer that ran to its own end: 200, complete, not cut by the deadline, not left by its client."""
    return (
        rec.get("status") == 200
        and rec.get("error") is None
        and not rec.get("hung_up")
        and rec.get("done")
        and rec.get("finish_reason") in ("stop", "length")
        and rec.get("spec_finish") != "timeout"
    )


def _brief(rec: dict) -> dict:
    return {k: rec.get(k) for k in ("i", "kind", "variant", "status", "error", "finish_reason", "generation")}


def _result(cases: list, judged: bool = True, **detail) -> dict:
    return {"pass": (not cases) if judged else None, "failures": len(cases), "cases": cases[:20], **detail}


def check_5xx(records: list[dict], server_metrics: list[dict]) -> dict:
    bad = []
    for r in records:
        status, code = r.get("status"), error_code(r)
        if status is not None and status >= 500 and not (status == 503 and code in DOCUMENTED_503):
            bad.append(_brief(r))
        elif (
            r.get("error_event")
            and code not in DOCUMENTED_503
            and code is not None
            and (code in ("internal_error", "engine_error") or code.startswith("server"))
        ):
            bad.append(_brief(r))
    server = Counter()
    for snap in server_metrics:
        for key, value in snap.items():
            if key.startswith("specdecode_requests_total{") and 'status="5' in key and 'status="503"' not in key:
                server[key] += value
    bad += [{"server_counted": k, "count": v} for k, v in server.items() if v]
    return _result(bad)


def greedy_partings(records: list[dict], recheck: list[dict]) -> tuple[list[dict], int, list[dict]]:
    """The finished greedy answers that part from the same request's answer alone: ({"i", "body", "at_char",
    "alone", "under_load"} with the whole texts, how many were compared, those whose request went unanswered alone)."""
    from .soak import request_key

    alone = {r["key"]: r for r in recheck}
    parted, compared, unanswered = [], 0, []
    for r in records:
        if "body" not in r or not finished(r):
            continue
        ref = alone.get(request_key(r["body"]) + repr(r["body"].get("prediction")))
        if ref is None:
            continue  # past the recheck's bound
        if not finished(ref):
            unanswered.append({**_brief(r), "alone": _brief(ref)})
            continue
        compared += 1
        at = first_difference(ref["text"], r["text"])
        if at is not None:
            parted.append(
                {
                    **_brief(r),
                    "i": r["i"],
                    "body": r["body"],
                    "at_char": at,
                    "alone": ref["text"],
                    "under_load": r["text"],
                    "alone_finish": ref.get("finish_reason"),
                    "under_load_finish": r.get("finish_reason"),
                }
            )
    return parted, compared, unanswered


def check_greedy(records: list[dict], recheck: list[dict], tolerance: float = 0.0, ties: dict | None = None) -> dict:
    """Every finished greedy answer equals the same request's alone, or parts from it at a near-tie: ties (from
    soak_ties.score_partings, where the target could be read) holds the two parting tokens' logit gap, scored by the
    target alone; within its tie tolerance the difference is numerical (batched passes round otherwise than one
    alone: docs/serving/batching.md). tolerance: the share of compared answers that may differ otherwise."""
    parted, compared, unanswered = greedy_partings(records, recheck)
    bad, near = [], []
    for p in parted:
        at, tie = p["at_char"], (ties or {}).get(str(p["i"]))
        window = slice(max(0, at - 30), at + 40)
        case = {**p, "alone": p["alone"][window], "under_load": p["under_load"][window], "tie": tie}
        (near if tie and tie.get("near_tie") else bad).append(case)
    gaps = [abs(c["tie"]["gap"]) for c in near + bad if c["tie"] and c["tie"].get("gap") is not None]
    res = _result(
        bad + unanswered,
        judged=compared > 0,
        compared=compared,
        mismatches=len(parted),
        near_ties=len(near),
        scored=ties is not None,
        max_gap=max(gaps, default=None),
        tolerance=tolerance,
    )
    res["near_tie_cases"] = near[:20]
    if compared and not unanswered and len(bad) <= tolerance * compared:
        res["pass"] = True
    return res


def check_terminal(records: list[dict]) -> dict:
    bad = []
    for r in records:
        if r.get("status") != 200 or r.get("hung_up"):
            continue
        if r.get("stream"):
            ok = r.get("error_event") or (r.get("done") and r.get("finish_reason"))
        else:
            ok = r.get("done") and r.get("finish_reason")
        if not ok:
            bad.append(_brief(r))
    return _result(bad)


def _down(r: dict, restart: dict | None) -> bool:
    """Whether the request was sent or running while the server was down (SIGTERM to the new one's answer)."""
    return (
        restart is not None
        and r["t_start"] <= restart["t_ready"] + RESTART_SLACK_S
        and r["t_end"] >= restart["t_sigterm"]
    )


def closed_unread(r: dict, restart: dict | None) -> bool:
    """Whether the stopping server closed the connection without reading the request: no status, the connection
    dropped between the SIGTERM and the old server's exit, and that exit clean (0, or uvicorn raising the SIGTERM
    it caught again once shut down) and inside uvicorn's graceful timeout. A graceful exit answers every request it
    read (its wait covers every started request cycle), so such a request was never taken, like a refused one; a
    connection in the listen backlog or not yet read when the listener closes is dropped this way by any server."""
    return (
        restart is not None
        and r.get("status") is None
        and not r.get("refused")
        and not r.get("hung_up")
        and str(r.get("error") or "").startswith(("ReadError", "RemoteProtocolError"))
        and restart.get("exit_code") in (0, -signal.SIGTERM)
        and restart.get("exit_s") is not None
        and restart["exit_s"] < GRACEFUL_SHUTDOWN_S
        and restart["t_sigterm"] <= r["t_end"] <= restart["t_exit"] + RESTART_SLACK_S
    )


def check_loss(records: list[dict], restart: dict | None) -> dict:
    bad = [
        _brief(r)
        for r in records
        if r.get("status") is None
        and r.get("error")
        and not r.get("hung_up")
        and not (r.get("refused") and _down(r, restart))
        and not closed_unread(r, restart)
    ]
    return _result(bad)


def check_restart(records: list[dict], restart: dict | None) -> dict:
    if restart is None:
        return _result([], judged=False, detail="no restart (a server not launched here, or --soak-restart off)")
    during = [r for r in records if _down(r, restart)]
    unread = {r["i"] for r in during if closed_unread(r, restart)}
    bad = [
        _brief(r)
        for r in during
        if not r.get("hung_up")
        and not r.get("refused")
        and r["i"] not in unread
        and (r.get("status") is None or (r["status"] == 200 and not (r.get("error_event") or r.get("done"))))
    ]
    outcomes = Counter(
        "refused"
        if r.get("refused")
        else "left by client"
        if r.get("hung_up")
        else "closed unread"
        if r["i"] in unread
        else f"{r.get('status')}" + (f" {error_code(r)}" if error_code(r) else "")
        for r in during
    )
    return _result(
        bad, during=len(during), outcomes=dict(outcomes), **{k: v for k, v in restart.items() if not k.startswith("t_")}
    )


def check_refusals(records: list[dict], restart: dict | None = None) -> dict:
    """Every malformed or oversized request got a 4xx, or met a server that was down or closed it unread as it
    stopped (closed_unread: the restart criterion judges those)."""
    bad = [
        _brief(r)
        for r in records
        if r["kind"] in ("malformed", "oversized")
        and not r.get("refused")
        and not (r.get("status") is not None and 400 <= r["status"] < 500)
        and not closed_unread(r, restart)
    ]
    return _result(bad)


def check_idle(idle: dict, drift: float) -> dict:
    before, after = idle.get("before") or {}, idle.get("after") or {}
    bad, detail = [], {"rss_before_mib": before.get("rss_mib"), "rss_after_mib": after.get("rss_mib")}
    if before.get("rss_mib") and after.get("rss_mib") is not None:
        change = after["rss_mib"] / before["rss_mib"] - 1
        detail["rss_drift"] = round(change, 4)
        if change >= drift:
            bad.append({"rss": f"{before['rss_mib']} -> {after['rss_mib']} MiB ({change:+.1%}, limit {drift:.0%})"})
    gb, ga = before.get("gauges") or {}, after.get("gauges") or {}
    for key, value in ga.items():
        idle_value = gb.get(key, 0.0)
        if value > idle_value * (1 + drift) and value - idle_value > 0:
            bad.append({"gauge": key, "before": idle_value, "after": value})
    detail["gauges_after"] = ga
    detail["kv_cells"] = {
        k: v for k, v in ga.items() if "kv" in k or "cells" in k
    } or "not exposed by the server (/health, /metrics)"
    judged = bool(ga) or detail.get("rss_drift") is not None
    return _result(bad, judged=judged, **detail)


def latencies(records: list[dict]) -> dict:
    ok = [r for r in records if finished(r) and r.get("stream")]
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    itl = [x for r in ok for x in r.get("itl_s") or ()]
    e2e = [r["e2e_s"] for r in records if finished(r) and r.get("e2e_s") is not None]
    out = {"streams": len(ok), "ttft_n": len(ttft), "itl_n": len(itl)}
    for name, xs in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        out[f"{name}_p50_s"], out[f"{name}_p99_s"] = percentile(xs, 50), percentile(xs, 99)
    return out


def check_latency(quiet: list[dict], records: list[dict], restart: dict | None, factor: float, floor_s: float) -> dict:
    q = latencies([r for r in quiet if r["kind"] == "honest"])
    s = latencies([r for r in records if r["kind"] == "honest" and not _down(r, restart)])
    bad, judged = [], True
    for name in ("ttft", "itl"):
        a, b = q[f"{name}_p99_s"], s[f"{name}_p99_s"]
        if a is None or b is None or q[f"{name}_n"] < 5 or s[f"{name}_n"] < 5:
            judged = False
            continue
        if b > factor * a + floor_s:
            bad.append(
                {
                    name: f"p99 {b * 1000:.1f} ms under the soak against {a * 1000:.1f} ms quiet "
                    f"(limit {factor:g}x + {floor_s * 1000:.0f} ms)"
                }
            )
    return _result(bad, judged=judged or bool(bad), quiet=q, soak=s, factor=factor, floor_s=floor_s)


def judge(out: dict) -> dict:
    """Every criterion of the module's docstring over a soak_run.Soak result."""
    cfg, records, restart = out["config"], out["records"], out.get("restart")
    everything = out["quiet"] + records + out["recheck"]
    return {
        "no_5xx": check_5xx(everything, out.get("server_metrics") or []),
        "greedy_alone": check_greedy(
            out["quiet"] + records, out["recheck"], cfg.get("greedy_tolerance", 0.0), out.get("ties")
        ),
        "terminal_events": check_terminal(everything),
        "no_silent_loss": check_loss(everything, restart),
        "restart": check_restart(records, restart),
        "refusals": check_refusals(records, restart),
        "idle_memory": check_idle(out.get("idle") or {}, cfg["drift"]),
        "latency": check_latency(out["quiet"], records, restart, cfg["latency_factor"], cfg["latency_floor_s"]),
    }


def summary(out: dict, criteria: dict) -> dict:
    records = out["records"]
    statuses = Counter(
        str(r.get("status"))
        if r.get("status") is not None
        else ("refused" if r.get("refused") else "left by client" if r.get("hung_up") else "no response")
        for r in records
    )
    codes = Counter(f"{r.get('status')} {error_code(r)}" for r in records if error_code(r))
    return {
        "passed": all(c["pass"] is not False for c in criteria.values()),
        "requests": len(records),
        "quiet_requests": len(out["quiet"]),
        "rechecked": len(out["recheck"]),
        "by_kind": dict(Counter(r["kind"] for r in records)),
        "by_variant": dict(sorted(Counter(r["variant"] for r in records).items())),
        "by_status": dict(statuses.most_common()),
        "errors_by_code": dict(codes.most_common()),
        "deadline_cut": sum(1 for r in records if r.get("spec_finish") == "timeout" or error_code(r) == "timeout"),
        "phases": out.get("phases"),
        "restart": out.get("restart"),
        "model": out.get("model"),
    }


def write_report(out: dict, criteria: dict, folder: str | Path, cpu: str | None = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    summ = summary(out, criteria)
    compact = lambda rs: [{k: v for k, v in r.items() if k not in ("itl_s", "body", "text")} for r in rs]  # noqa: E731
    doc = {
        "summary": summ,
        "criteria": criteria,
        "config": out["config"],
        "cpu": cpu,
        "idle": out.get("idle"),
        "records": compact(out["records"]),
        "quiet": compact(out["quiet"]),
        "recheck": compact(out["recheck"]),
    }
    (folder / "soak.json").write_text(json.dumps(doc, indent=1, default=str))
    (folder / "soak.md").write_text(markdown(summ, criteria, out["config"], cpu))
    return folder


def _cell(text: str) -> str:
    return json.dumps(text)[:80].replace("|", "\\|")


def _ms(x) -> str:
    return "n/a" if x is None else f"{x * 1000:.1f}"


def markdown(summ: dict, criteria: dict, cfg: dict, cpu: str | None = None) -> str:
    verdict = "PASSED" if summ["passed"] else "FAILED"
    lines = [
        f"# Soak test: {verdict}",
        "",
        f"{cfg['minutes']:g} min of load at concurrency {cfg['concurrency']} against "
        f"`{cfg.get('command') or cfg.get('url')}`; model {summ['model']}; CPU: {cpu or 'unknown'}",
        "",
        f"Requests: {summ['requests']} under the soak (+ {summ['quiet_requests']} in the quiet run, "
        f"{summ['rechecked']} greedy ones again alone); cut by the deadline: {summ['deadline_cut']}",
        "",
        "| criterion | result | failures | detail |",
        "|---|---|---|---|",
    ]
    for name, c in criteria.items():
        result = {True: "pass", False: "**FAIL**", None: "not judged"}[c["pass"]]
        detail = {
            k: v for k, v in c.items() if k not in ("pass", "failures", "cases", "quiet", "soak", "near_tie_cases")
        }
        lines.append(f"| {name} | {result} | {c['failures']} | {json.dumps(detail, default=str)[:300]} |")
    lat = criteria["latency"]
    lines += [
        "",
        "| latency (ms) | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | e2e p50 | e2e p99 | streams |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ("quiet", "soak"):
        s = lat[name]
        lines.append(
            f"| {name} | {_ms(s['ttft_p50_s'])} | {_ms(s['ttft_p99_s'])} | {_ms(s['itl_p50_s'])} | "
            f"{_ms(s['itl_p99_s'])} | {_ms(s['e2e_p50_s'])} | {_ms(s['e2e_p99_s'])} | {s['streams']} |"
        )
    mem = criteria["idle_memory"]
    lines += [
        "",
        f"Server RSS when idle: {mem.get('rss_before_mib')} MiB before the load, "
        f"{mem.get('rss_after_mib')} MiB after it; KV cells in use: {json.dumps(mem.get('kv_cells'))}",
        "",
    ]
    for title, table in (
        ("Requests by kind", summ["by_kind"]),
        ("Requests by variant", summ["by_variant"]),
        ("Outcomes by status", summ["by_status"]),
        ("Errors by code", summ["errors_by_code"]),
    ):
        lines += [f"## {title}", "", "| | count |", "|---|---|"] + [f"| {k} | {v} |" for k, v in table.items()] + [""]
    near = criteria["greedy_alone"].get("near_tie_cases") or []
    if near:
        lines += [
            "## Greedy answers that parted at a near-tie (first 20)",
            "",
            "| request | parts at char | logit gap (alone) | tie tolerance | alone | under load |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {c['i']} {c['variant']} | {c['at_char']} | {c['tie']['gap']} | {c['tie']['tie']} | "
            f"{_cell(c['alone'])} | {_cell(c['under_load'])} |"
            for c in near
        ] + [""]
    failed = [(name, c) for name, c in criteria.items() if c["cases"]]
    if failed:
        lines += ["## Failures (first 20 per criterion)", ""]
        for name, c in failed:
            lines += [f"- {name}: `{json.dumps(case, default=str)[:400]}`" for case in c["cases"]]
    return "\n".join(lines) + "\n"
