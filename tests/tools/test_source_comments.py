"""Comments and docstrings state the present reason; measurements live in docs/results/notes.md. A source comment
that names a machine or a commit is a measurement told in the code: it fails here, unless the allow-list below names
it with its reason; the design pages name none either. Every docs page and anchor a comment links exists."""

import io
import re
import tokenize
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MACHINE = re.compile(
    r"\b(Xeon|EPYC|Zen ?[1-6]|Ryzen|Threadripper|Graviton|Sapphire Rapids|Genoa|Milan|"
    r"H100|H200|A100|A10G|RTX ?\d{4}|M[1-4] (Pro|Max|Ultra))\b"
)
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")  # hex with a letter and a digit
DOC_LINK = re.compile(r"\bdocs/([\w./-]+\.md)(?:#([\w-]+))?")
# (path relative to the root, the word found): why that comment must name it. Only for a data table or constant
# whose meaning is a machine; a measurement goes to docs/results/notes.md instead.
ALLOWED: dict[tuple[str, str], str] = {}


def prose(path: Path, text: str | None = None):
    """(line, text) of every comment and docstring of a Python file (tokenize: code and other strings are not read),
    or of every comment of a shell script."""
    text = path.read_text() if text is None else text
    if path.suffix != ".py":
        for n, line in enumerate(text.splitlines(), 1):
            m = re.search(r"(?:^|\s)(#(?!!).*)$", line)
            if m:
                yield n, m.group(1)
        return
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    starts = (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING)
    ends = (tokenize.NEWLINE, tokenize.ENDMARKER, tokenize.COMMENT)
    before = None  # the last token that is not a comment or a blank line
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
        elif tok.type == tokenize.STRING and (before is None or before.type in starts) and tokens[i + 1].type in ends:
            for k, line in enumerate(tok.string.splitlines()):  # a string statement: a docstring
                yield tok.start[0] + k, line
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            before = tok


def findings(files: dict[str, str], allowed: dict[tuple[str, str], str]) -> list[str]:
    """What names a machine or a commit in these files' comments ({relative path: text}), less what `allowed`
    names; an allowed entry that matches nothing is reported too (its reason went away)."""
    found, used = [], set()
    for rel, text in sorted(files.items()):
        for n, line in prose(Path(rel), text):
            for rx, kind in ((MACHINE, "a machine"), (COMMIT, "a commit")):
                for m in rx.finditer(line):
                    if (rel, m.group(0)) in allowed:
                        used.add((rel, m.group(0)))
                    else:
                        found.append(f"{rel}:{n}: names {kind} ({m.group(0)}): {line.strip()[:100]}")
    found += [f"{rel}: allowed {word!r} is no longer named" for rel, word in sorted(set(allowed) - used)]
    return found


def sources() -> dict[str, str]:
    paths = list((ROOT / "src/specdecode").rglob("*.py")) + list((ROOT / "scripts").rglob("*.py"))
    paths += list((ROOT / "scripts").rglob("*.sh"))
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted(paths)}


def slug(heading: str) -> str:
    """Python-Markdown's toc slug of a heading's text."""
    text = re.sub(r"[`*]", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def anchors(page: Path) -> set[str]:
    out = set()
    for line in page.read_text().splitlines():
        m = re.match(r"#+\s+(.*?)\s*(\{#([\w-]+)\})?\s*$", line)
        if m:
            out.add(m.group(3) or slug(m.group(1)))
    return out


def test_the_scanner_reads_comments_and_docstrings_only():
    text = (
        '"""Module docstring, measured on a Xeon."""\n'
        'X = "Zen 4"  # a string that is data, and this comment is plain\n'
        "def f():\n"
        '    """Measured at commit e58bbcb."""\n'
        "    return 1  # on an H200\n"
    )
    assert findings({"m.py": text}, {}) == [
        'm.py:1: names a machine (Xeon): """Module docstring, measured on a Xeon."""',
        'm.py:4: names a commit (e58bbcb): """Measured at commit e58bbcb."""',
        "m.py:5: names a machine (H200): # on an H200",
    ]
    shell = "#!/bin/sh\necho $# # Zen 4 run\n"
    assert findings({"s.sh": shell}, {}) == ["s.sh:2: names a machine (Zen 4): # Zen 4 run"]
    allowed = {("m.py", "Xeon"): "r", ("m.py", "e58bbcb"): "r", ("m.py", "H200"): "r", ("m.py", "EPYC"): "stale"}
    assert findings({"m.py": text}, allowed) == ["m.py: allowed 'EPYC' is no longer named"]


def test_no_source_comment_names_a_machine_or_a_commit():
    files = sources()
    assert len(files) > 100
    assert findings(files, ALLOWED) == []


def test_every_docs_link_in_a_source_comment_resolves():
    checked = 0
    for rel, text in sources().items():
        for n, line in prose(Path(rel), text):
            for m in DOC_LINK.finditer(line):
                page = ROOT / "docs" / m.group(1)
                assert page.is_file(), f"{rel}:{n}: no page docs/{m.group(1)}"
                if m.group(2):
                    assert m.group(2) in anchors(page), f"{rel}:{n}: no anchor #{m.group(2)} in docs/{m.group(1)}"
                    checked += 1
    assert checked >= 20  # the measured asides' links into the notes


def test_no_design_page_names_a_machine_or_a_commit():
    """docs/design describes the design; its measurements are in docs/results/notes.md."""
    pages = sorted((ROOT / "docs/design").glob("*.md"))
    assert len(pages) >= 4
    found = [
        f"{p.name}:{n}: {m.group(0)}"
        for p in pages
        for n, line in enumerate(p.read_text().splitlines(), 1)
        for rx in (MACHINE, COMMIT)
        for m in rx.finditer(line)
    ]
    assert found == []
