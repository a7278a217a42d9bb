"""A three-turn chat against an OpenAI-compatible server: time to the first token of each turn (streamed, greedy,
32 new tokens a turn), to see what a prompt cache saves on a conversation's later turns.

    python scripts/multiturn_ttft.py URL DEVSET.jsonl [MODEL]

DEVSET.jsonl: rows with `turns` (the first row's first turn opens the chat), e.g. from scripts/longprompt_devset.py.
MODEL: the model id the server serves (default qwen2.5-coder-1.5b-instruct).
"""

import json
import sys
import time

import httpx

url, path = sys.argv[1], sys.argv[2]
row = json.loads(open(path).readline())
doc = row["turns"][0]
msgs = [{"role": "user", "content": doc}]
model = sys.argv[3] if len(sys.argv) > 3 else "qwen2.5-coder-1.5b-instruct"


def turn(msgs):
    t0, first, text = time.perf_counter(), None, ""
    body = {
        "model": model,
        "messages": msgs,
        "max_tokens": 32,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])
                if d.get("choices") and d["choices"][0]["delta"].get("content"):
                    first = first or time.perf_counter() - t0
                    text += d["choices"][0]["delta"]["content"]
                if d.get("usage"):
                    usage = d["usage"]
    return first, time.perf_counter() - t0, text, usage


out = []
for k in range(3):
    f, tot, text, usage = turn(msgs)
    out.append(
        {"turn": k + 1, "prompt_tokens": usage["prompt_tokens"], "ttft_s": round(f, 2), "total_s": round(tot, 2)}
    )
    print(out[-1], flush=True)
    follow_up = ["Say more.", "And then?", "Thanks."][k]
    msgs = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": follow_up}]
