#!/usr/bin/env python3
"""Build a development set of edit tasks (the workload of Predicted Outputs) from licensed code already on
this machine: functions of Python's own standard library (PSF-2.0), 30-150 lines each.

Each row is a chat prompt that `specdecode bench` reads (`turns`, `category`, and `prediction`: the text the
answer is expected to repeat, as an editor plug-in sends it), with where the code came from and its licence:

    {"question_id": "rename-03", "category": "rename", "turns": ["Rename ... Return the whole function ..."],
     "prediction": "```python\\n<the original function>\\n```", "source": {"file": "json/decoder.py",
     "function": "py_scanstring", "lines": 74}, "licence": "PSF-2.0"}

Categories: rename (a local name or parameter), type_hints, logging, default (change one argument's default),
docstring (rewrite the first line of the docstring). The answer repeats the function except at a few points.
--whole-files N adds N tasks of category whole_file: a whole standard-library module of 100-300 lines (about 1,000-1,600
tokens) with one of the edits above made to one of its functions, the answer being the whole updated file.
--prediction none leaves the prediction out (the original is then only in the prompt); --prediction wrong sends
another function as the prediction (a prediction that is wrong from the start). The data is never committed:
this script is. The same Python and --seed give the same file.

    python scripts/edit_devset.py --per-category 3               # -> $SPECDECODE_CACHE/devset/edits.jsonl
    specdecode bench --prompts ~/.cache/specdecode/devset/edits.jsonl --max-new-tokens 384 \\
        --methods autoregressive,auto,llama.cpp
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import sysconfig
from pathlib import Path

CATEGORIES = ("rename", "type_hints", "logging", "default", "docstring")
LINES = (30, 150)
FILES = (
    "json/decoder.py",
    "json/encoder.py",
    "argparse.py",
    "textwrap.py",
    "difflib.py",
    "csv.py",
    "ftplib.py",
    "shlex.py",
    "configparser.py",
    "tarfile.py",
    "zipfile/__init__.py",
    "pprint.py",
    "inspect.py",
    "tokenize.py",
    "email/_header_value_parser.py",
    "http/cookiejar.py",
    "urllib/parse.py",
    "calendar.py",
    "fractions.py",
    "statistics.py",
    "heapq.py",
    "string.py",
    "gettext.py",
    "mailbox.py",
    "smtplib.py",
)


def default_out() -> Path:
    root = os.environ.get("SPECDECODE_CACHE")
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdecode"
    return base.expanduser() / "devset" / "edits.jsonl"


def functions(stdlib: Path):
    """(file, name, source, node) of every function of 30-150 lines with a body worth editing."""
    for rel in FILES:
        path = stdlib / rel
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and LINES[0] <= node.end_lineno - node.lineno + 1 <= LINES[1]:
                indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
                src = "\n".join(line[indent:] for line in lines[node.lineno - 1 : node.end_lineno])
                yield rel, node.name, src, node


def locals_of(node: ast.FunctionDef) -> list[str]:
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    names |= {a.arg for a in node.args.args if a.arg not in ("self", "cls")}
    return sorted(n for n in names if len(n) >= 3 and not n.startswith("_"))


def instruction(category: str, name: str, node: ast.FunctionDef, rng: random.Random) -> str | None:
    if category == "rename":
        names = locals_of(node)
        if not names:
            return None
        old = rng.choice(names)
        return f"Rename `{old}` to `new_{old}` everywhere in this function."
    if category == "type_hints":
        return "Add type hints to the parameters and the return value of this function. Change nothing else."
    if category == "logging":
        return (
            f"Add a `logger.debug(...)` call at the start of `{name}` that logs its arguments "
            "(assume `logger` is defined at module level). Change nothing else."
        )
    if category == "default":
        with_default = [a.arg for a, d in zip(node.args.args[::-1], node.args.defaults[::-1])]
        if not with_default:
            return None
        return (
            f"Change the default value of the parameter `{rng.choice(with_default)}` to None, and handle None "
            "at the start of the function. Change nothing else."
        )
    if category == "docstring":
        return (
            "Rewrite the first line of this function's docstring (add one if it has none) so that it says "
            "precisely what the function returns. Change nothing else."
        )
    raise ValueError(category)


WHOLE_LINES, WHOLE_CHARS = (100, 300), (3500, 5500)


def modules(stdlib: Path):
    """(file, text) of the standard library's top-level modules of WHOLE_LINES lines and WHOLE_CHARS characters."""
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if WHOLE_LINES[0] <= text.count("\n") <= WHOLE_LINES[1] and WHOLE_CHARS[0] <= len(text) <= WHOLE_CHARS[1]:
            yield path.name, text


def whole_files(count: int, seed: int, prediction: str) -> list[dict]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    pool = list(modules(stdlib))
    rng = random.Random(seed + 1)
    rng.shuffle(pool)
    rows: list[dict] = []
    for rel, text in pool:
        if len(rows) >= count:
            break
        funcs = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno > 4]
        if not funcs:
            continue
        node = rng.choice(funcs)
        category = CATEGORIES[len(rows) % len(CATEGORIES)]
        edit = instruction(category, node.name, node, rng) or instruction("type_hints", node.name, node, rng)
        edit = edit.replace("this function", f"the function `{node.name}`")
        prompt = (
            f"In the file below: {edit} Return the whole updated file in one ```python code block and nothing "
            f"else.\n\n```python\n{text}```"
        )
        row = {
            "question_id": f"file-{len(rows) + 1:02d}",
            "category": "whole_file",
            "turns": [prompt],
            "source": {"file": rel, "function": node.name, "lines": text.count("\n")},
            "licence": "PSF-2.0",
        }
        if prediction == "original":
            row["prediction"] = f"```python\n{text}```"
        elif prediction == "wrong":
            row["prediction"] = f"```python\n{pool[-1 - len(rows)][1]}```"
        rows.append(row)
    return rows


def build(per_category: int, seed: int, prediction: str) -> list[dict]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    pool = list(functions(stdlib))
    rng = random.Random(seed)
    rng.shuffle(pool)
    rows: list[dict] = []
    used = 0
    for category in CATEGORIES:
        made = 0
        while made < per_category and used < len(pool):
            rel, name, src, node = pool[used]
            used += 1
            text = instruction(category, name, node, rng)
            if text is None:
                continue
            made += 1
            prompt = (
                f"{text} Return the whole function in one ```python code block and nothing else.\n\n"
                f"```python\n{src}\n```"
            )
            row = {
                "question_id": f"{category}-{made:02d}",
                "category": category,
                "turns": [prompt],
                "source": {"file": rel, "function": name, "lines": src.count("\n") + 1},
                "licence": "PSF-2.0",
            }
            if prediction == "original":
                row["prediction"] = f"```python\n{src}\n```"
            elif prediction == "wrong":  # another function: nothing of it is the answer
                other = pool[(used + len(pool) // 2) % len(pool)][2]
                row["prediction"] = f"```python\n{other}\n```"
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="JSONL file to write (default: the cache's devset/)")
    ap.add_argument("--per-category", type=int, default=3, help="tasks per category (default 3: 15 tasks)")
    ap.add_argument("--whole-files", type=int, default=0, help="whole-file tasks to add (default 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--prediction",
        choices=("original", "none", "wrong"),
        default="original",
        help="the prediction each task sends: the original function (default), none, or another one",
    )
    args = ap.parse_args()
    rows = build(args.per_category, args.seed, args.prediction) if args.per_category else []
    rows += whole_files(args.whole_files, args.seed, args.prediction)
    out = args.out or default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} tasks written to {out}")


if __name__ == "__main__":
    main()
