"""What per-token sources cost a stream: the same greedy chat requests streamed with and without
`stream_options.include_sources`, interleaved (the order alternates each round) against one running server, compared
by the server's decode speed (speculation.decode_tokens_per_second: tokens after the first, per second, measured
where the sources are computed) and by the client's (content chunks after the first).

    specdecode serve --port 8000 &            # any model, method and options (a quiet machine)
    python scripts/sources_overhead.py --url http://127.0.0.1:8000 --rounds 10 --max-tokens 256

Prints one JSON object: per mode the median speeds, and the median of each round's ratio (with / without).
"""

import argparse
import http.client
import json
import statistics
import time
from urllib.parse import urlsplit

PROMPTS = [
    "Write a Python function that merges two sorted lists, with a docstring and three doctests.",
    "Explain the difference between a process and a thread, with an example in Python.",
    "Rename the variable x to count everywhere:\n\ndef f(items):\n    x = 0\n    for i in items:\n"
    "        if i:\n            x += 1\n    return x\n",
]


def stream(url: str, model: str, prompt: str, max_tokens: int, sources: bool, key: str | None) -> dict:
    """One streamed chat answer: its text, the server's decode speed and the client's."""
    parts = urlsplit(url)
    conn = (http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection)(
        parts.netloc, timeout=600
    )
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if sources:
        body["stream_options"] = {"include_sources": True}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request("POST", f"{parts.path.rstrip('/')}/v1/chat/completions", json.dumps(body), headers)
    response = conn.getresponse()
    if response.status != 200:
        raise SystemExit(f"the server answered {response.status}: {response.read().decode()[:500]}")
    text, times, spec = "", [], {}
    for line in response:
        line = line.decode().strip()
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise SystemExit(f"the stream failed: {chunk['error']}")
        spec = chunk.get("speculation") or spec
        for choice in chunk["choices"]:
            piece = choice["delta"].get("content")
            if piece:
                text += piece
                times.append(time.perf_counter())
    conn.close()
    client = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 else None  # chunks/s, not tokens/s
    return {"text": text, "server": spec.get("decode_tokens_per_second"), "client": client}


def model_id(url: str, key: str | None) -> str:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.netloc, timeout=60)
    conn.request(
        "GET", f"{parts.path.rstrip('/')}/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {}
    )
    return json.loads(conn.getresponse().read())["data"][0]["id"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args()
    if args.rounds < 1 or args.max_tokens < 2:
        raise SystemExit("--rounds must be at least 1 and --max-tokens at least 2")
    model = model_id(args.url, args.api_key)
    stream(args.url, model, PROMPTS[0], 16, True, args.api_key)  # warm: the first request's one-off costs
    runs = {True: [], False: []}
    ratios = []
    for r in range(args.rounds):
        for prompt in PROMPTS:
            pair = {}
            for sources in (True, False) if r % 2 == 0 else (False, True):
                pair[sources] = stream(args.url, model, prompt, args.max_tokens, sources, args.api_key)
                runs[sources].append(pair[sources])
            if pair[True]["text"] != pair[False]["text"]:
                raise SystemExit("the two modes' greedy answers differ: the comparison would not be fair")
            if pair[True]["server"] and pair[False]["server"]:
                ratios.append(pair[True]["server"] / pair[False]["server"])

    def median(mode, key):
        values = [x[key] for x in runs[mode] if x[key]]
        return round(statistics.median(values), 3) if values else None

    print(
        json.dumps(
            {
                "requests_per_mode": len(runs[True]),
                "max_tokens": args.max_tokens,
                "with_sources": {
                    "server_decode_tok_s": median(True, "server"),
                    "client_chunks_s": median(True, "client"),
                },
                "without": {"server_decode_tok_s": median(False, "server"), "client_chunks_s": median(False, "client")},
                "median_ratio_with_over_without": round(statistics.median(ratios), 4) if ratios else None,
                "overhead_percent": round(100 * (1 - statistics.median(ratios)), 2) if ratios else None,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
