#!/usr/bin/env python3
"""A whole-file edit streamed on the Engine: time to the first token and the longest gap between streamed pieces of
text, to check that a long answer never stalls (no context made anew, no text read again mid-generation).

The prompt is a Python standard-library module (PSF-2.0, already on this machine) cut to about --prompt-tokens tokens,
with an instruction to return the whole file with one change; the file is also the prediction (as an editor sends
it) unless --no-prediction. Greedy, max_new_tokens = --max-tokens.

    python scripts/long_edit_stream.py                                   # default pair, 3,000 + 3,000, method auto
    python scripts/long_edit_stream.py --method autoregressive --no-prediction

Prints one JSON line: prompt and new tokens, ttft_s, the longest gap between two steps that emitted tokens (and after
how many), the longest between two pieces of streamed text, decode tokens per second, the draft's catch-up seconds,
the contexts made while the generation ran (after its prompt was read; 0 expected) and the target's cells at the end;
exits 1 if the longest token gap is over --max-gap-s (default 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

from specdecode import Engine

INSTRUCTION = (
    "Rename every local variable called `result` to `out` in the file below. Return the whole updated file "
    "in one ```python code block, nothing else.\n\n"
)


def source_file(engine: Engine, tokens: int) -> str:
    """A standard-library module's text cut at a line end to about `tokens` tokens (the largest of a few modules
    that has that many)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "typing.py", "inspect.py", "tarfile.py", "pathlib.py"):
        path = lib / name
        if not path.is_file():
            continue
        lines, out, n = path.read_text().splitlines(keepends=True), [], 0
        for line in lines:
            n += len(engine.encode(line))
            if n > tokens:
                return "".join(out)
            out.append(line)
    raise SystemExit(f"no standard-library module of {tokens} tokens found under {lib}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target model (default: the default pair's)")
    ap.add_argument("--draft", default=None, help="draft model (default: the default pair's)")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=3000)
    ap.add_argument("--no-prediction", action="store_true")
    ap.add_argument("--max-gap-s", type=float, default=2.0)
    ap.add_argument("--raw", action="store_true", help="the prompt as it is, no chat template (a model without one)")
    args = ap.parse_args()

    engine = Engine.load(args.target, args.draft)
    code = source_file(engine, args.prompt_tokens)
    prompt = INSTRUCTION + "```python\n" + code + "```\n"
    prediction = None if args.no_prediction else "```python\n" + code + "```"

    target, made = engine.target, []
    new_context = getattr(target, "_new_context", None)
    if new_context is not None:  # llama.cpp: count the contexts made once the prompt is in the cache

        def spy(cells):
            made.append(len(target.ids))
            new_context(cells)

        target._new_context = spy

    stream = engine.stream(
        prompt, chat=not args.raw, method=args.method, max_new_tokens=args.max_tokens, prediction=prediction
    )
    steps, texts = [], []  # (seconds, tokens so far) at each step of the loop; seconds at each piece of text

    def timed(inner):
        n = 0
        for new in inner:
            n += len(new)
            steps.append((time.perf_counter(), n))
            yield new

    stream.steps = timed(stream.steps)
    t0 = time.perf_counter()
    for _ in stream:
        texts.append(time.perf_counter())
    stats = stream.result.stats
    token_gap, after = max(((b[0] - a[0], a[1]) for a, b in zip(steps, steps[1:])), default=(0.0, 0))
    text_gap = max((b - a for a, b in zip(texts, texts[1:])), default=0.0)
    first = steps[0][0] - t0 if steps else None
    report = {
        "method": args.method,
        "prediction": not args.no_prediction,
        "prompt_tokens": stats.prompt_tokens,
        "new_tokens": stats.new_tokens,
        "finish_reason": stats.finish_reason,
        "ttft_s": None if first is None else round(first, 2),
        # between two steps that emitted tokens (the check), and between two pieces of streamed text (a
        # piece may wait for the bytes of a character, or for a stop string to be ruled out)
        "longest_token_gap_s": round(token_gap, 3),
        "longest_gap_after_tokens": after,
        "longest_text_gap_s": round(text_gap, 3),
        "decode_tokens_per_s": round(stats.new_tokens / max(1e-9, steps[-1][0] - steps[0][0]), 2) if steps else 0,
        "draft_catchup_s": round(stats.catchup_s, 2),
        "contexts_made_mid_generation": sum(1 for n in made if n > 0),
        "target_cells": getattr(target, "_cells", None),
    }
    print(json.dumps(report), flush=True)
    return 0 if token_gap <= args.max_gap_s else 1


if __name__ == "__main__":
    sys.exit(main())
