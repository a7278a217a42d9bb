"""The leaderboard (docs/results/index.md) keeps one row per benchmark and machine, its latest run: a newer run
replaces the row, and the one it replaces moves to the measurement notes. Every row names its date, commit and
report, and the report is there."""

import datetime
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def tables(text: str) -> dict[str, list[dict[str, str]]]:
    """{section heading: its table's rows as {column: cell}} of a markdown page (one table a section)."""
    out, section, head = {}, "", None
    for line in text.splitlines():
        if line.startswith("## "):
            section, head = line[3:].strip(), None
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if head is None:
                head = cells
            elif not set(line) <= set("|-: "):
                out.setdefault(section, []).append(dict(zip(head, cells)))
        else:
            head = None
    return out


def duplicates(text: str) -> list[str]:
    """Rows whose (benchmark, machine) an earlier row of the same section already has."""
    found = []
    for section, rows in tables(text).items():
        seen = {}
        for row in rows:
            key = tuple(" ".join(row[c].lower().split()) for c in ("benchmark", "machine"))
            if key in seen:
                found.append(f"{section}: {key} on {seen[key]} and on {row['date']}")
            seen.setdefault(key, row["date"])
    return found


def test_duplicates_finds_a_second_row_of_a_benchmark_on_a_machine():
    page = (
        "## Served\n\n| benchmark | run | date | machine |\n|---|---|---|---|\n"
        "| 16 prompts | c = 1 | 2026-12-06 | Intel Xeon |\n| 16 prompts | c = 8 | 2026-12-05 | AMD EPYC |\n"
        "| 16  Prompts | c = 4 | 2026-12-05 | intel xeon |\n\n"
        "## Other\n\n| benchmark | date | machine |\n|---|---|---|\n| 16 prompts | 2026-12-01 | Intel Xeon |\n"
    )
    assert duplicates(page) == ["Served: ('16 prompts', 'intel xeon') on 2026-12-06 and on 2026-12-05"]


def test_the_leaderboard_has_one_row_per_benchmark_and_machine():
    text = (RESULTS / "index.md").read_text()
    sections = tables(text)
    assert sum(len(rows) for rows in sections.values()) >= 25
    for section, rows in sections.items():
        for row in rows:
            assert {"benchmark", "machine", "date", "commit", "report"} <= set(row), (section, row)
            datetime.date.fromisoformat(row["date"])
            assert re.match(r"[0-9a-f]{7}\b", row["commit"]), row
            link = re.fullmatch(r"\[[^]]+\]\(([^)]+)\)", row["report"])
            assert link and (RESULTS / link.group(1)).is_file(), row["report"]
    assert duplicates(text) == []
