"""The load client of `specdecode loadtest`: real streamed OpenAI requests against a server at a
fixed concurrency, and what a user of that server sees.

Closed loop: `concurrency` clients each send their next request as soon as their last one ends, until
the level's requests are spent. Every request is greedy (temperature 0), streamed, with
`stream_options.include_usage`; a prompt row with `chat` goes to /v1/chat/completions as one user message,
the others to /v1/completions (rows as `launch.prompts.load_prompts` reads them).

Per request: the text, completion tokens (the final `usage` chunk's count, else the number of chunks
that carried text), time to first token (first text chunk), inter-token latency (gaps between text
chunks, as vLLM's benchmark counts it: a chunk that carries several tokens counts once), time per output
token ((last chunk - first chunk) / (tokens - 1)) and any error (HTTP status, an SSE error event, a
stream without `[DONE]`, a transport error). Per level: total completion tokens per second (all the
level's tokens over its wall time, first request sent to last one done), p50/p99 of those latencies,
and the errors (5xx counted apart).

Greedy check: a greedy answer must not depend on the company it had, so each request's text at
concurrency > 1 is compared with the same prompt's answer from the solo level (concurrency 1), and so is each
answer of a later solo level (a second round on the same server); a mismatch is reported (where it starts),
it does not stop the run.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def request_body(row: dict, model: str, max_tokens: int, extra: dict | None = None) -> tuple[str, dict]:
    """extra: more fields a server needs to decode greedily (llama-cpp-python's: its repeat_penalty)."""
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    if row.get("chat"):
        body["messages"] = [{"role": "user", "content": row["prompt"]}]
        return "/v1/chat/completions", body
    body["prompt"] = row["prompt"]
    return "/v1/completions", body


async def one_request(
    client,
    url: str,
    model: str,
    row: dict,
    max_tokens: int,
    clock=time.perf_counter,
    extra: dict | None = None,
    body: dict | None = None,
    hang_up=None,
) -> dict:
    """Send one request; returns its record (see the module's docstring). body: the request as sent (default:
    request_body's, streamed; chat where it has `messages`); a body without `stream` gets its JSON answer read.
    hang_up(rec): asked before each line of a stream (first right after its headers), True closes the connection
    there, as a client that leaves (rec["hung_up"])."""
    if body is None:
        path, body = request_body(row, model, max_tokens, extra)
    else:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    chat = "messages" in body
    rec = {
        "id": row["id"],
        "status": None,
        "error": None,
        "text": "",
        "usage_tokens": None,
        "prompt_tokens": None,
        "finish_reason": None,
        "spec_finish": None,
        "done": False,
        "error_event": False,
        "keepalives": 0,
        "hung_up": False,
    }
    times = []
    start = clock()
    try:
        async with client.stream("POST", url.rstrip("/") + path, json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                detail = (await r.aread()).decode("utf-8", "replace")[:300]
                rec["error"] = f"HTTP {r.status_code}: {detail}"
            elif body.get("stream"):
                await _read_events(r, rec, times, chat, clock, hang_up)
            else:
                _read_answer(json.loads(await r.aread()), rec, chat)
    except Exception as e:  # noqa: BLE001 - a transport or protocol failure is a result here, not a crash
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    end = clock()
    rec["e2e_s"] = end - start
    rec["chunks"] = len(times)
    rec["tokens"] = rec["usage_tokens"] if rec["usage_tokens"] is not None else len(times)
    rec["ttft_s"] = times[0] - start if times else None
    rec["itl_s"] = [b - a for a, b in zip(times, times[1:])]
    rec["tpot_s"] = (times[-1] - times[0]) / (rec["tokens"] - 1) if times and rec["tokens"] > 1 else None
    rec["start"], rec["end"] = start, end
    return rec


async def _read_events(r, rec: dict, times: list, chat: bool, clock, hang_up) -> None:
    """A 200 stream's events into `rec` (text, finish_reason, usage, the speculation's finish_reason, whether
    [DONE] came), each text chunk's arrival into `times`; a stream without [DONE] or with an error event is an
    error."""
    if hang_up is not None and hang_up(rec):
        rec["hung_up"] = True
        return
    async for line in r.aiter_lines():
        if hang_up is not None and hang_up(rec):
            rec["hung_up"] = True
            return
        if line.startswith(":"):
            rec["keepalives"] += 1
        if not line.startswith("data:"):
            continue  # keep-alive comments, blank separators
        data = line[5:].strip()
        if data == "[DONE]":
            rec["done"] = True
            return
        obj = json.loads(data)
        if "error" in obj:
            rec["error"] = f"stream error event: {json.dumps(obj['error'])[:300]}"
            rec["error_event"] = True
            return
        _read_chunk(obj, rec, times, chat, clock)
    if rec["error"] is None:
        rec["error"] = "the stream ended without [DONE]"


def _read_chunk(obj: dict, rec: dict, times: list, chat: bool, clock) -> None:
    usage = obj.get("usage")
    if usage:
        rec["usage_tokens"] = usage.get("completion_tokens")
        rec["prompt_tokens"] = usage.get("prompt_tokens")
    if isinstance(obj.get("speculation"), dict) and obj["speculation"].get("finish_reason"):
        rec["spec_finish"] = obj["speculation"]["finish_reason"]
    for choice in obj.get("choices") or []:
        piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        if piece:
            times.append(clock())
            rec["text"] += piece
        if choice.get("finish_reason"):
            rec["finish_reason"] = choice["finish_reason"]


def _read_answer(obj: dict, rec: dict, chat: bool) -> None:
    """A JSON (not streamed) answer into `rec`."""
    usage = obj.get("usage") or {}
    rec["usage_tokens"], rec["prompt_tokens"] = usage.get("completion_tokens"), usage.get("prompt_tokens")
    rec["spec_finish"] = (obj.get("speculation") or {}).get("finish_reason")
    choice = (obj.get("choices") or [{}])[0]
    rec["text"] = ((choice.get("message") or {}).get("content") if chat else choice.get("text")) or ""
    rec["finish_reason"] = choice.get("finish_reason")
    rec["done"] = True


async def run_level_async(
    url: str,
    model: str,
    rows: list[dict],
    concurrency: int,
    max_tokens: int,
    timeout: float = 600.0,
    clock=time.perf_counter,
    transport=None,
    extra: dict | None = None,
) -> tuple[dict, list[dict]]:
    """Send `rows` (one request each, in order) with `concurrency` clients; returns (summary, records)."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    pending = iter(rows)
    records: list[dict] = []
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:

        async def worker():
            for row in pending:  # one shared iterator: each row goes to whichever client is free first
                records.append(await one_request(client, url, model, row, max_tokens, clock, extra))

        t0 = clock()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = clock() - t0
    return summarize_level(records, wall, concurrency), records


def run_level(*args, **kw) -> tuple[dict, list[dict]]:
    return asyncio.run(run_level_async(*args, **kw))


def summarize_level(records: list[dict], wall_s: float, concurrency: int) -> dict:
    ok = [r for r in records if r["error"] is None]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    itl = [x for r in ok for x in r["itl_s"]]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    e2e = [r["e2e_s"] for r in ok]
    errors = [r for r in records if r["error"] is not None]
    kinds = Counter(r["error"][:120] for r in errors)
    out = {
        "concurrency": concurrency,
        "requests": len(records),
        "ok": len(ok),
        "errors": len(errors),
        "errors_5xx": sum(1 for r in errors if r["status"] is not None and r["status"] >= 500),
        "error_kinds": dict(kinds.most_common(5)),
        "completion_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
    }
    for name, xs in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", e2e)):
        out[f"{name}_p50_s"] = percentile(xs, 50)
        out[f"{name}_p99_s"] = percentile(xs, 99)
    return out


def first_difference(a: str, b: str) -> int | None:
    """The index where two texts first differ (the shorter one's length if one is a prefix), None if equal."""
    if a == b:
        return None
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def greedy_mismatches(solo: dict[str, str], records: list[dict], concurrency: int) -> list[dict]:
    """Every successful record whose text differs from its prompt's solo answer."""
    out = []
    for r in records:
        ref = solo.get(r["id"])
        if r["error"] is not None or ref is None:
            continue
        at = first_difference(ref, r["text"])
        if at is not None:
            out.append(
                {
                    "id": r["id"],
                    "concurrency": concurrency,
                    "at_char": at,
                    "solo": ref[max(0, at - 20) : at + 40],
                    "got": r["text"][max(0, at - 20) : at + 40],
                }
            )
    return out


def level_rows(prompts: list[dict], concurrency: int, requests: int | None) -> list[dict]:
    """The requests of one level: the prompts in order, cycled to `requests` (default: every prompt once,
    and at least one per client)."""
    n = requests or max(len(prompts), concurrency)
    return [prompts[i % len(prompts)] for i in range(n)]


def server_model(url: str, timeout: float = 30.0) -> str:
    """The first model id the server lists at /v1/models (what our server requires as `model`)."""
    from ..launch import http

    r = http.get(url.rstrip("/") + "/v1/models", timeout=timeout)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def measure_server(
    url: str,
    prompts: list[dict],
    levels: list[int],
    max_tokens: int,
    requests: int | None = None,
    timeout: float = 600.0,
    warmup: bool = True,
    model: str | None = None,
    log=print,
    solo: dict[str, str] | None = None,
    extra: dict | None = None,
    on_start=None,
) -> dict:
    """Every concurrency level against one running server: {"levels": [...], "mismatches": [...],
    "solo": {id: text}}. The solo answers come from level 1 (or `solo`, from an earlier run). `extra`: fields
    added to every request body. `on_start`: called after the warm-up, right before the levels' load."""
    model = model or server_model(url)
    if warmup:
        run_level(url, model, prompts[:1], 1, min(8, max_tokens), timeout, extra=extra)
    if on_start is not None:
        on_start()
    solo = {} if solo is None else solo  # filled in place by level 1
    out = {"levels": [], "mismatches": [], "requests": [], "solo": solo}
    for c in levels:
        summary, records = run_level(url, model, level_rows(prompts, c, requests), c, max_tokens, timeout, extra=extra)
        earlier = dict(solo)  # concurrency 1 again (a later round) is checked against the first answers
        if c == 1:
            for r in records:
                if r["error"] is None:
                    solo.setdefault(r["id"], r["text"])
        ref = solo if c > 1 else earlier
        mismatches = greedy_mismatches(ref, records, c)
        summary["greedy_mismatches"] = len(mismatches)
        summary["greedy_compared"] = sum(1 for r in records if r["error"] is None and r["id"] in ref)
        out["levels"].append(summary)
        out["mismatches"] += mismatches
        out["requests"] += [{"concurrency": c, **{k: r[k] for k in COMPACT}} for r in records]
        log(format_summary(summary))
    return out


COMPACT = (
    "id",
    "status",
    "error",
    "tokens",
    "chunks",
    "usage_tokens",
    "prompt_tokens",
    "finish_reason",
    "ttft_s",
    "tpot_s",
    "e2e_s",
)


def format_summary(s: dict) -> str:
    def ms(x):
        return "n/a" if x is None else f"{x * 1000:.0f} ms"

    rate = "n/a" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:.2f}"
    return (
        f"  concurrency {s['concurrency']}: {s['ok']}/{s['requests']} ok, {rate} tok/s, "
        f"TTFT p50 {ms(s['ttft_p50_s'])} p99 {ms(s['ttft_p99_s'])}, ITL p50 {ms(s['itl_p50_s'])} "
        f"p99 {ms(s['itl_p99_s'])}, errors {s['errors']} (5xx {s['errors_5xx']}), "
        f"greedy mismatches {s.get('greedy_mismatches', 0)}"
    )
