"""The test suite's own layout: test files live in folders by contract and cost, with names that say what they
test, and the cost markers are the registered four (`stat`, `model`, `cluster`, `process`)."""

import re
import tomllib
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
FOLDERS = {"unit", "contract", "engine", "law", "serving", "tools", "models"}
HELPERS = {"conftest.py", "tiny.py", "tinygguf.py", "helpers.py", "fake_llama_server.py"}
HISTORY_WORDS = {"issue", "run", "stop", "silent"}  # what happened, not what is tested
MARKERS = {"stat", "model", "cluster", "process"}


def layout_errors(paths: list[str]) -> list[str]:
    """What is wrong with test files at these paths (relative to tests/, '/'-separated)."""
    errors, seen = [], {}
    for path in paths:
        parts = path.split("/")
        name = parts[-1]
        if len(parts) == 1:
            errors.append(f"{path}: directly in tests/ (shelve it in one of {sorted(FOLDERS)})")
        elif len(parts) != 2 or parts[0] not in FOLDERS:
            errors.append(f"{path}: not in one of {sorted(FOLDERS)}")
        words = set(name.removesuffix(".py").split("_"))
        if words & HISTORY_WORDS or "long_context" in name or re.search(r"\d", name):
            errors.append(f"{path}: a name after history (a history word or a number), not after what it tests")
        if name in seen:  # no __init__.py: pytest imports test modules by basename
            errors.append(f"{path}: the same basename as {seen[name]}")
        seen.setdefault(name, path)
    return errors


def test_tests_live_in_folders_by_contract_and_cost():
    paths = sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py"))
    assert len(paths) > 30
    assert layout_errors(paths) == []
    assert not list(TESTS.glob("test_*.py"))  # none directly in tests/
    assert {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))} == FOLDERS
    assert all(list((TESTS / f).glob("test_*.py")) for f in FOLDERS)  # no empty folder
    assert HELPERS <= {p.name for p in TESTS.glob("*.py")}  # the shared helpers stay in tests/
    assert not list(TESTS.rglob("__init__.py"))  # basenames stay unique instead


def test_the_layout_check_sees_what_it_forbids():
    """Negative control: each kind of misplaced or misnamed file is caught."""
    bad = {
        "test_verify.py": "directly in tests/",
        "misc/test_verify_law.py": "not in one of",
        "engine/sub/test_tree_law.py": "not in one of",
        "engine/test_issue_numbers.py": "history",
        "engine/test_silent_paths.py": "history",
        "engine/test_long_context.py": "history",
        "serving/test_soak_run.py": "history",
        "engine/test_stop_words.py": "history",
        "law/test_step12.py": "history",
    }
    for path, why in bad.items():
        errors = layout_errors([path])
        assert len(errors) == 1 and why in errors[0], (path, errors)
    assert any("same basename" in e for e in layout_errors(["unit/test_tree.py", "engine/test_tree.py"]))
    assert layout_errors(["unit/test_verify.py", "law/test_lossless_engine.py", "tools/test_runnable_docs.py"]) == []


def test_the_cost_markers_are_registered_and_slow_is_gone():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {m.split(":")[0].split("(")[0].strip() for m in config["markers"]}
    assert MARKERS <= registered and "slow" not in registered
    assert "tests" in config["pythonpath"]  # `from tiny import ...` from every folder
    used = set()
    for path in TESTS.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"mark\.slow\b", text), path
        used |= set(re.findall(r"pytest\.mark\.(stat|model|cluster|process)\b", text))
    assert used == MARKERS
