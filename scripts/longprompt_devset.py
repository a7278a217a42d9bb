#!/usr/bin/env python3
"""Build a development set of long-prompt, input-grounded tasks from licensed texts already on this
machine: the READMEs, docs and Python sources of the packages installed in the active Python's
site-packages (summaries, questions over a document, code edits and translation reuse the
prompt's tokens, which is where lookup drafting should pay).

The data is never committed: this script is. Each row is a chat prompt that `specdecode bench`
reads (`bench.load_prompts`: `turns` and `category`), with where its text came from and that text's
licence (from the distribution's METADATA: License-Expression, the License classifiers, or the
License field; a text whose licence is not stated there is skipped):

    {"question_id": "summary-01", "category": "summary", "turns": ["Summarize the following text ..."],
     "source": {"package": "requests", "version": "2.32.3", "file": "requests-2.32.3.dist-info/METADATA"},
     "licence": "Apache-2.0", "approx_tokens": 1234}

Categories: summary, doc_qa, code_edit, translation (--per-category of each, default 5). Prompts are
600-2000 tokens long, approximated as characters / 4 (--min-tokens, --max-tokens). The same
site-packages and --seed give the same file.

    python scripts/longprompt_devset.py                      # -> $SPECDECODE_CACHE/devset/longprompt.jsonl
    specdecode bench --prompts ~/.cache/specdecode/devset/longprompt.jsonl --methods autoregressive,auto,llama.cpp
"""

from __future__ import annotations

import argparse
import ast
import csv
import io
import json
import os
import random
import re
import site
import sys
import sysconfig
from email.parser import HeaderParser
from pathlib import Path

CATEGORIES = ("summary", "doc_qa", "code_edit", "translation")
CHARS_PER_TOKEN = 4  # the approximation of prompt length in tokens
TEXT_SUFFIXES = (".md", ".rst", ".txt")
SKIP_NAMES = re.compile(
    r"licen[cs]e|copying|notice|authors|contributors|entry_points|top_level|requires|"
    r"dependency_links|sources|installed-files|record|wheel|zip-safe|api_tests",
    re.I,
)
CODE_LINES = (60, 200)
EXCLUDE = {"specdecode"}  # our own package: its README is the project's, and changes with it


def default_out() -> Path:
    """Beside the models, in the repository's cache folder (SPECDECODE_CACHE, else ~/.cache/specdecode)."""
    try:
        from specdecode.host import cache_dir
    except ImportError:  # the same rule as specdecode.host.cache_dir, without importing torch's package
        root = os.environ.get("SPECDECODE_CACHE")
        base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdecode"
        return base.expanduser() / "devset" / "longprompt.jsonl"
    return cache_dir() / "devset" / "longprompt.jsonl"


def default_site_packages() -> list[Path]:
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    try:
        paths += site.getsitepackages()
    except AttributeError:
        pass
    seen, out = set(), []
    for p in paths:
        p = Path(p).resolve()
        if p.is_dir() and p not in seen:
            seen.add(p)
            out.append(p)
    return out


# ------------------------------------------------------------------ licences and the files of a package


def licence_of(meta) -> str | None:
    """The licence a distribution's METADATA states, or None where it states none."""
    expr = (meta.get("License-Expression") or "").strip()
    if expr:
        return expr
    classifiers = [
        c.split("::")[-1].strip()
        for c in meta.get_all("Classifier") or []
        if c.startswith("License ::") and c.split("::")[-1].strip() not in ("OSI Approved", "")
    ]
    if classifiers:
        return "; ".join(dict.fromkeys(classifiers))
    text = (meta.get("License") or "").strip()
    if not text or text.upper() in ("UNKNOWN", "NONE", "N/A", "OTHER", "LICENSE", "SEE LICENSE", "SEE LICENSE FILE"):
        return None
    first = text.splitlines()[0].strip()
    if len(text) > 100:  # the whole licence text pasted into the field: name it by its first line
        return first[:100] or None
    return first


def read_meta(dist_info: Path):
    try:
        raw = (dist_info / "METADATA").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return HeaderParser().parsestr(raw)


def record_files(dist_info: Path) -> list[str]:
    """The files a distribution installed (its RECORD), relative to site-packages."""
    try:
        text = (dist_info / "RECORD").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return sorted({row[0] for row in csv.reader(io.StringIO(text)) if row and not row[0].startswith("..")})


def packages(roots: list[Path]) -> list[dict]:
    """Every distribution with a stated licence: name, version, licence, its METADATA long description,
    its documentation files and its Python sources (paths under the root)."""
    out = []
    for root in roots:
        for dist_info in sorted(root.glob("*.dist-info")):
            meta = read_meta(dist_info)
            if meta is None or not meta.get("Name") or meta["Name"].lower() in EXCLUDE:
                continue
            licence = licence_of(meta)
            if licence is None:
                continue
            files = record_files(dist_info)
            body = meta.get_payload() or ""
            if isinstance(body, list):
                body = ""
            out.append(
                {
                    "name": meta["Name"],
                    "version": meta.get("Version", ""),
                    "licence": licence,
                    "root": root,
                    "dist_info": dist_info.name,
                    "description": body or (meta.get("Description") or ""),
                    # vendored copies (pip/_vendor/...) carry their own licences: left out
                    "docs": [
                        f
                        for f in files
                        if f.lower().endswith(TEXT_SUFFIXES)
                        and "_vendor" not in f
                        and not SKIP_NAMES.search(Path(f).name)
                    ],
                    "sources": [
                        f
                        for f in files
                        if f.endswith(".py")
                        and "/tests/" not in f"/{f}"
                        and "_vendor" not in f
                        and not Path(f).name.startswith("test_")
                    ],
                }
            )
    out.sort(key=lambda p: (p["name"].lower(), p["version"], str(p["root"])))
    return out


# ------------------------------------------------------------------ texts

# badges, images and lines of bare HTML markup (an <a ...> around a removed badge...)
BADGE = re.compile(
    r"^\s*(\[!\[|!\[|\.\. image::|\.\. \|.*\| image::|<img |<a href=.*<img|<p align|"
    r"\s*:(target|alt|width|height|align):|(</?[a-zA-Z][^>]*>\s*)+$)"
)


def clean(text: str) -> str:
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").splitlines() if not BADGE.match(ln)]
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, a fenced code block never split."""
    blocks, cur, fenced = [], [], False
    for ln in text.splitlines():
        if ln.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if not ln.strip() and not fenced:
            if cur:
                blocks.append("\n".join(cur))
                cur = []
            continue
        cur.append(ln)
    if cur:
        blocks.append("\n".join(cur))
    return blocks


def is_prose(text: str) -> bool:
    """Mostly sentences: letters dominate, and most lines are not code or table rows."""
    letters = sum(c.isalpha() for c in text)
    visible = sum(not c.isspace() for c in text)
    if not visible or letters / visible < 0.65:
        return False
    lines = [ln for ln in text.splitlines() if ln.strip()]
    fenced, code = False, 0
    for ln in lines:
        if ln.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if fenced or ln.startswith(("    ", "\t", ">>>", "|", "+-")):
            code += 1
    words = len(re.findall(r"[A-Za-z]{3,}", text))
    return code <= 0.5 * len(lines) and words >= 250


def excerpts(text: str, lo_chars: int, hi_chars: int) -> list[str]:
    """The text cut at paragraph breaks into consecutive pieces of lo_chars to hi_chars characters (a
    paragraph longer than hi_chars ends the piece before it and is skipped)."""
    out, kept, size = [], [], 0
    for block in paragraphs(text):
        if size + len(block) + 2 > hi_chars:
            if size >= lo_chars:
                out.append("\n\n".join(kept))
            kept, size = [], 0
            if len(block) > hi_chars:
                continue
        kept.append(block)
        size += len(block) + 2
    if size >= lo_chars:
        out.append("\n\n".join(kept))
    return [o for o in out if lo_chars <= len(o) <= hi_chars]


def read(pkg: dict, rel: str) -> str | None:
    try:
        return (pkg["root"] / rel).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def doc_texts(pkg: dict) -> list[tuple[str, str]]:
    """(file, text) of a package's prose: its METADATA long description, then its .md/.rst/.txt files."""
    out = []
    if pkg["description"].strip():
        out.append((f"{pkg['dist_info']}/METADATA", pkg["description"]))
    for rel in pkg["docs"]:
        text = read(pkg, rel)
        if text:
            out.append((rel, text))
    return out


# ------------------------------------------------------------------ the tasks


def _summary(rng, pkg, text):
    form = rng.choice(["in one paragraph", "in five bullet points", "in three to five sentences"])
    return (
        f"Summarize the following text from the documentation of the Python package {pkg['name']} {form}. "
        f"Keep the names of functions, options and commands exactly as they are written.\n\n---\n{text}\n---"
    )


def _doc_qa(rng, pkg, text):
    name = pkg["name"]
    asks = [
        f"Using only the text below, explain what {name} is for and describe its main features, quoting "
        "the names it uses."
    ]
    if re.search(r"pip install|conda install|\binstall", text, re.I):
        asks.append(
            f"Using only the text below, explain how to install {name} and how to use it, with the "
            "commands or code it gives."
        )
    names = sorted(set(re.findall(r"`{1,2}([A-Za-z_][\w.]*)\(?\)?`{1,2}", text)))
    if len(names) >= 3:
        asks.append(
            "Using only the text below, list the functions, classes, options or commands it describes, "
            "each with a one-line explanation taken from the text."
        )
    heads = [h.strip("# ").strip() for h in re.findall(r"^#{1,4} .+$", text, re.M)]
    heads += [m.group(1).strip() for m in re.finditer(r"^(.+)\n[=\-~^]{3,}\s*$", text, re.M)]
    heads = [h for h in heads if 3 <= len(h) <= 60]
    if len(heads) >= 2:
        h = rng.choice(heads[1:])
        asks.append(
            f'Using only the text below, explain what the section "{h}" says, in your own words but '
            "keeping its code and names exactly."
        )
    ask = rng.choice(asks)
    return f"{ask} If the text does not say, answer that it does not.\n\n---\n{text}\n---"


def _translation(rng, pkg, text):
    return (
        "Translate the following text into French. Keep the Markdown or reStructuredText markup, the code, "
        "the names of functions, options and commands, and the links unchanged; translate everything else."
        f"\n\n---\n{text}\n---"
    )


def code_requests(rng, tree: ast.Module, source: str) -> list[str]:
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    asks = [
        "Add type hints and docstrings to every function in the following Python file; change nothing "
        "else. Return the whole file.",
        "Add a short comment above every function in the following Python file that says what it does, and "
        "a module docstring if it has none. Return the whole updated file.",
    ]
    public = sorted({f.name for f in funcs if not f.name.startswith("__") and len(f.name.strip("_")) >= 3})
    if public:
        old = rng.choice(public)
        new = next(
            n
            for n in (f"{old.lstrip('_')}_impl", f"do_{old.lstrip('_')}", f"{old}_v2")
            if not re.search(rf"\b{re.escape(n)}\b", source)
        )
        asks.append(
            f"Rename the function {old} to {new} in the following Python file, updating every call "
            "and reference to it. Return the whole updated file."
        )
    if re.search(r"%\s*\(|\"\s*%\s|'\s*%\s|\.format\(", source):
        asks.append(
            "Rewrite every %-formatting and str.format() call in the following Python file as an "
            "f-string, changing nothing else. Return the whole updated file."
        )
    return asks


def _code_edit(rng, pkg, rel, source, tree):
    return f"{rng.choice(code_requests(rng, tree, source))}\n\n# {rel}\n```python\n{source.rstrip()}\n```"


def build(
    roots: list[Path], per_category: int = 5, seed: int = 0, min_tokens: int = 600, max_tokens: int = 2000
) -> list[dict]:
    rng = random.Random(seed)
    pkgs = packages(roots)
    # the prompt's own words cost ~60-80 tokens: the text gets the rest of the range
    lo, hi = (min_tokens - 40) * CHARS_PER_TOKEN, (max_tokens - 100) * CHARS_PER_TOKEN
    texts, codes = [], []
    for pkg in pkgs:
        for rel, raw in doc_texts(pkg):
            pieces = excerpts(clean(raw), lo, rng.randint(max(lo, min(hi, 3 * lo)), hi))
            # a long description's first pieces are about the package; later ones are often a changelog
            for k, body in enumerate(pieces[:2], 1):
                if is_prose(body):
                    texts.append((pkg, rel if len(pieces) == 1 else f"{rel} (part {k} of {len(pieces)})", body))
        for rel in pkg["sources"]:
            src = read(pkg, rel)
            if not src or not CODE_LINES[0] <= len(src.splitlines()) <= CODE_LINES[1]:
                continue
            if not lo <= len(src) <= hi:
                continue
            try:
                tree = ast.parse(src)
            except (SyntaxError, ValueError):
                continue
            if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in tree.body) or any(
                isinstance(n, ast.ClassDef) for n in tree.body
            ):
                codes.append((pkg, rel, src, tree))
    rng.shuffle(texts)
    rng.shuffle(codes)
    used: set = set()

    def pick(pool, categories, n):
        """Up to n items for each category, dealt in turns, a package not yet in the category first; no
        text goes to two prompts."""
        chosen: dict = {c: [] for c in categories}
        for _ in range(n):
            for c in categories:
                names = {item[0]["name"] for item in chosen[c]}
                free = [item for item in pool if (item[0]["name"], item[1]) not in used]
                item = next((i for i in free if i[0]["name"] not in names), free[0] if free else None)
                if item is not None:
                    chosen[c].append(item)
                    used.add((item[0]["name"], item[1]))
        return chosen

    rows = []

    def add(category, pkg, rel, prompt):
        tokens = len(prompt) // CHARS_PER_TOKEN
        if not min_tokens <= tokens <= max_tokens:
            return False
        n = sum(r["category"] == category for r in rows) + 1
        rows.append(
            {
                "question_id": f"{category}-{n:02d}",
                "category": category,
                "turns": [prompt],
                "source": {"package": pkg["name"], "version": pkg["version"], "file": rel},
                "licence": pkg["licence"],
                "approx_tokens": tokens,
            }
        )
        return True

    makers = {"summary": _summary, "doc_qa": _doc_qa, "translation": _translation}
    for category, items in pick(texts, list(makers), per_category).items():
        for pkg, rel, body in items:
            add(category, pkg, rel, makers[category](rng, pkg, body))
    for pkg, rel, src, tree in pick(codes, ["code_edit"], per_category)["code_edit"]:
        add("code_edit", pkg, rel, _code_edit(rng, pkg, rel, src, tree))
    order = {c: i for i, c in enumerate(CATEGORIES)}
    rows.sort(key=lambda r: (order[r["category"]], r["question_id"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--site-packages",
        action="append",
        type=Path,
        default=None,
        help="a folder of installed distributions (*.dist-info); repeatable (default: the active "
        "Python's site-packages)",
    )
    ap.add_argument("--per-category", type=int, default=5, help="prompts per category (default 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-tokens", type=int, default=600, help="shortest prompt, in approximate tokens")
    ap.add_argument("--max-tokens", type=int, default=2000, help="longest prompt, in approximate tokens")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSONL file to write (default: <specdecode cache>/devset/longprompt.jsonl)",
    )
    args = ap.parse_args(argv)
    if args.per_category <= 0 or not 0 < args.min_tokens < args.max_tokens:
        ap.error("--per-category must be positive and 0 < --min-tokens < --max-tokens")
    roots = args.site_packages or default_site_packages()
    rows = build(roots, args.per_category, args.seed, args.min_tokens, args.max_tokens)
    out = (args.out or default_out()).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    counts = {c: sum(r["category"] == c for r in rows) for c in CATEGORIES}
    print(
        f"wrote {len(rows)} prompts to {out}: "
        + ", ".join(f"{c} {n}" for c, n in counts.items())
        + f" (from {len({r['source']['package'] for r in rows})} packages in {', '.join(map(str, roots))})"
    )
    short = [c for c, n in counts.items() if n < args.per_category]
    if short:
        print(
            f"fewer than {args.per_category} prompts for: {', '.join(short)} (not enough licensed texts of "
            "that length)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
