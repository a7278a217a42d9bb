"""The docs as a contract: the README's shape and set-up commands, dotted names that resolve, paths that
exist, and the examples marked runnable run on the tiny test models.

Every fenced ```python block in the docs sits right after a marker line (invisible on GitHub and in the
MkDocs site): `<!-- runnable -->` runs it as written, with `Engine.load()` without a target loading the tiny
test models instead of the default pair. `<!-- runnable: prediction -->` marks an example of predicted outputs
(run the same way). `<!-- runnable: server -->` marks a client example: it runs against `specdecode serve`'s
app on the tiny models, at the address the example names (http://127.0.0.1:8000, replaced by the test
server's). `<!-- runnable: llama.cpp -->` loads tiny GGUF models instead (what only llama.cpp runs, such as
`Slots`). `<!-- not run: REASON -->` is for what the suite cannot run (a Ray cluster), with the reason.
Examples run in a scratch directory holding what they read: `app.py`, and `~/ds`, a datastore of it.
"""

import argparse
import importlib
import inspect
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 250


def doc_files() -> list[Path]:
    return [README] + sorted(DOCS.rglob("*.md"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# --- (a) the README's shape ------------------------------------------------------------------------------


def readme_problems(text: str) -> list[str]:
    """What is wrong with a README's shape: too long, or not opening with the two set-up commands."""
    lines = text.split("\n")
    problems = []
    if len(lines) - (lines[-1] == "") > MAX_README_LINES:
        problems.append(f"{len(lines)} lines, more than {MAX_README_LINES}")
    fence = next((i for i, line in enumerate(lines) if line.startswith("```")), None)
    if (
        fence is None
        or lines[fence] != "```bash"
        or any(line.strip() for line in lines[1:fence] if not line.startswith("#"))
    ):
        problems.append("the first thing after the title must be the ```bash block of the set-up commands")
        return problems
    first, second = lines[fence + 1], lines[fence + 2]
    for cmd, head in (
        (first, "scripts/setup.sh models && . .venv/bin/activate && specdecode generate "),
        (second, "scripts/setup.sh models,test && . .venv/bin/activate && python -m pytest "),
    ):
        if not cmd.startswith(head):
            problems.append(f"not a set-up command: {cmd[:80]!r}")
    if lines[fence + 3] != "```":
        problems.append("the set-up block holds more than the two commands")
    return problems


def test_readme_is_short_and_opens_with_the_setup_commands():
    assert readme_problems(README.read_text()) == []


def test_readme_shape_check_fails_on_a_long_readme_or_a_missing_command():
    text = README.read_text()
    assert readme_problems(text + "more\n" * MAX_README_LINES)
    lines = text.split("\n")
    fence = lines.index("```bash")
    assert readme_problems("\n".join(lines[: fence + 1] + lines[fence + 2 :]))  # the first command left out
    assert readme_problems("# specdecode\n\nSome prose first.\n\n" + "\n".join(lines[fence:]))


def test_ci_runs_the_readme_test_command():
    """CI's command is the README's second set-up command, with ruff's checks and the docs build before the test run."""
    second = README.read_text().split("```bash\n", 1)[1].split("\n")[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "mkdocs build --strict" in ci
    ci_command = next(line for line in ci.split("\n") if line.startswith("scripts/setup.sh"))
    assert "ruff check src tests scripts && ruff format --check src tests scripts && " in ci_command
    checks = r"ruff check src tests scripts && ruff format --check src tests scripts && "
    assert re.sub(checks + r"(NO_MKDOCS_2_WARNING=1 )?mkdocs build --strict && ", "", ci_command) == second


def layout_entries(text: str) -> dict[str, str]:
    """The README layout's entries right under src/specdecode/: {"engine.py": "the Engine: ...", "server/": ...}."""
    block = text.split("## Layout\n", 1)[1].split("```\n", 1)[1].split("```", 1)[0]
    entries = re.findall(r"^[├└]── (\w+\.py|\w+/)(.*)$", block, re.M)
    assert len(entries) == len(dict(entries)), "an entry listed twice"
    return {name: what.strip() for name, what in entries}


def package_root() -> set[str]:
    """The modules (dunder files aside) and packages right under src/specdecode/."""
    src = ROOT / "src" / "specdecode"
    return {p.name for p in src.glob("*.py") if not p.name.startswith("__")} | {
        p.name + "/" for p in src.iterdir() if (p / "__init__.py").exists()
    }


def test_readme_layout_lists_every_root_module_with_a_line():
    entries = layout_entries(README.read_text())
    assert sorted(package_root() - set(entries)) == [], "missing from the README's layout"
    assert sorted(set(entries) - package_root()) == [], "in the README's layout, not in src/specdecode/"
    assert [name for name, what in entries.items() if not what] == [], "an entry without its line"


def test_layout_check_sees_a_module_left_out():
    text = README.read_text()
    assert "loop.py" in layout_entries(text) and "server/" in layout_entries(text)
    assert "loop.py" not in layout_entries(re.sub(r"^├── loop\.py .*\n", "", text, flags=re.M))
    assert "loop.py" in package_root()


def setup_block(text: str) -> str:
    return text.split("```bash\n", 1)[1].split("```", 1)[0]


def test_installation_page_shows_the_readme_setup_commands():
    page = (DOCS / "guide" / "backends.md").read_text()
    assert setup_block(page) == setup_block(README.read_text())
    assert setup_block("```bash\nold\n```\n") != setup_block(README.read_text())


# --- (d) no history in the README ------------------------------------------------------------------------

HISTORY = re.compile(r"issue [0-9]+|run [0-9]+|stop [0-9]+")


def test_readme_names_no_issue_run_or_stop():
    hits = [f"{i}: {line}" for i, line in enumerate(README.read_text().split("\n"), 1) if HISTORY.search(line)]
    assert hits == []
    assert HISTORY.search(f"as measured in run {27}") and HISTORY.search(f"see issue {16}")  # the pattern can hit


# --- (b) dotted names and paths ---------------------------------------------------------------------------

DOTTED = re.compile(r"(?<![\w./-])specdecode(?:\.[A-Za-z_]\w*)+")


def resolves(name: str) -> bool:
    """Whether `specdecode.a.b.C.d` names something as a reader's code reaches it: attribute by attribute from the
    package, a submodule imported where the attribute is not there yet (as `import specdecode.a.b` would), so a
    package attribute that hides its submodule (a function of the same name) does not pass."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for attr in parts[1:]:
        if not hasattr(obj, attr) and inspect.ismodule(obj) and hasattr(obj, "__path__"):
            try:
                importlib.import_module(f"{obj.__name__}.{attr}")
            except ModuleNotFoundError as e:
                if e.name != f"{obj.__name__}.{attr}":  # a dependency is missing, not the name
                    raise
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def dotted_names() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in doc_files():
        for name in DOTTED.findall(path.read_text()):
            found.setdefault(name.rstrip("."), []).append(rel(path))
    return found


def test_docs_mention_dotted_names():
    names = dotted_names()
    assert "specdecode.engine" in names and "specdecode.verify" in names  # the scan finds what is there


@pytest.mark.parametrize("name", sorted(dotted_names()))
def test_every_dotted_name_in_the_docs_resolves(name):
    assert resolves(name), f"{name} (in {', '.join(sorted(set(dotted_names()[name])))}) does not import"


def test_the_resolver_rejects_stale_and_made_up_names():
    assert resolves("specdecode.planning.tree.TreeDrafter") and resolves("specdecode.Engine.load")
    assert not resolves("specdecode.tree.TreeDrafter")  # where it lived before planning/
    assert not resolves("specdecode.costs")
    assert not resolves("specdecode.engine.no_such_thing")


def test_the_resolver_goes_by_attribute_where_a_package_hides_its_submodule(monkeypatch):
    import specdecode
    import specdecode.verify

    assert resolves("specdecode.verify.verify_tree")
    monkeypatch.setattr(specdecode, "verify", specdecode.verify.verify)  # the function in the module's place
    assert not resolves("specdecode.verify.verify_tree")  # importlib would still find the module
    assert DOTTED.findall("see `specdecode.planning.costs`, not docs/specdecode.x") == ["specdecode.planning.costs"]


SRC_PATH = re.compile(r"src/specdecode/[\w/]+\.py")


def test_source_paths_in_the_docs_exist():
    missing = [
        f"{rel(p)}: {m}" for p in doc_files() for m in SRC_PATH.findall(p.read_text()) if not (ROOT / m).exists()
    ]
    assert missing == []


def test_readme_points_at_the_file_that_holds_the_loop():
    m = re.search(r"`speculative_decode` in \[`(src/specdecode/[\w/]+\.py)`\]", README.read_text())
    assert m, "the README's 'How one step works' names the loop's file"
    assert "def speculative_decode(" in (ROOT / m.group(1)).read_text()


# --- (c) runnable examples --------------------------------------------------------------------------------

RUNNABLE = re.compile(r"^<!-- runnable(?:: (?P<tag>[\w.-]+))? -->\n```python\n(?P<code>.*?)^```$", re.M | re.S)
MARKER = re.compile(r"<!-- (runnable(: [\w.-]+)?|not run: \S.*) -->")


def unmarked_python_blocks(text: str) -> list[int]:
    """Line numbers of the ```python blocks that are neither marked runnable nor marked not run with a reason."""
    lines = text.split("\n")
    return [
        i + 1
        for i, line in enumerate(lines)
        if re.match(r"```\s*py(thon)?\b", line) and not (i and MARKER.fullmatch(lines[i - 1]))
    ]


def test_every_python_block_in_the_docs_is_run_or_says_why_not():
    found = {rel(p): unmarked_python_blocks(p.read_text()) for p in doc_files()}
    assert {path: lines for path, lines in found.items() if lines} == {}
    assert unmarked_python_blocks("text\n```python\nprint(1)\n```\n") == [2]
    assert unmarked_python_blocks("<!-- not run: -->\n```python\nprint(1)\n```\n") == [2]  # a reason is required
    assert unmarked_python_blocks("<!-- not run: needs a GPU -->\n```python\nprint(1)\n```\n") == []


def runnable_examples() -> list:
    out = []
    for path in doc_files():
        for i, m in enumerate(RUNNABLE.finditer(path.read_text())):
            out.append(pytest.param(m.group("code"), m.group("tag"), id=f"{rel(path)}#{i}"))
    return out


def test_readme_and_guide_have_runnable_examples():
    ids = [p.id for p in runnable_examples()]
    assert any(i.startswith("README.md#") for i in ids) and any(i.startswith("docs/guide/") for i in ids)
    assert not RUNNABLE.search("```python\nprint(1)\n```\n")  # a block without the marker is not run


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("docs-cache")  # pass costs of the tiny models, measured once for the module


def load_instead_of_the_default_pair(monkeypatch, target, draft):
    """Engine.load() without a target loads (target, draft) instead of the default pair."""
    from specdecode import Engine

    real = Engine.load.__func__

    def load(cls, target_name=None, draft_name=None, **kwargs):
        if target_name is None:
            target_name, draft_name = str(target), str(draft)
        kwargs.setdefault("progress", False)
        return real(cls, target_name, draft_name, **kwargs)

    monkeypatch.setattr(Engine, "load", classmethod(load))
    return Engine


@pytest.fixture
def tiny_load(tiny_dirs, shared_cache, monkeypatch):
    """Engine.load() without a target loads the tiny test models (torch) instead of the default pair."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(shared_cache))
    return load_instead_of_the_default_pair(monkeypatch, *tiny_dirs)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, tiny_dirs):
    """The directory the examples run in and their home: `app.py` and `~/ds`, a datastore of it (tiny tokenizer)."""
    from transformers import AutoTokenizer

    from specdecode.drafters.datastore import index_files

    root = tmp_path_factory.mktemp("docs-scratch")
    (root / "app.py").write_text("def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n")
    index_files([str(root / "app.py")], AutoTokenizer.from_pretrained(tiny_dirs[0]), root / "ds", progress=False)
    return root


SERVED_AT = "http://127.0.0.1:8000"
SERVED_MODEL = "qwen2.5-coder-1.5b-instruct"  # the default pair's name, which the examples send


@pytest.mark.parametrize("code, tag", runnable_examples())
def test_runnable_example(code, tag, tiny_load, scratch, monkeypatch, capsys):
    assert tag in (None, "prediction", "server", "llama.cpp"), f"unknown runnable tag {tag!r}"
    monkeypatch.chdir(scratch)
    monkeypatch.setenv("HOME", str(scratch))
    srv = None
    if tag == "llama.cpp":
        pytest.importorskip("llama_cpp")
        from tinygguf import write_tiny_gguf

        ggufs = [write_tiny_gguf(scratch / f"tiny-{seed}.gguf", seed, hidden=128) for seed in (0, 1)]
        load_instead_of_the_default_pair(monkeypatch, *ggufs)
    if tag == "server":
        from helpers import LiveServer
        from specdecode.server.app import create_app

        assert SERVED_AT in code, "a client example talks to the address serve prints"
        srv = LiveServer(create_app(tiny_load.load(), model_id=SERVED_MODEL, method="auto"))
        code = code.replace(SERVED_AT, srv.url)
    try:
        exec(compile(code, "<doc example>", "exec"), {"__name__": "__doc_example__"})
    finally:
        if srv is not None:
            srv.stop()
    assert capsys.readouterr().out.strip()  # every example prints something


def test_a_broken_example_fails(tiny_load):
    code = 'from specdecode import Engine\nEngine.load().generate("x", method="no-such-method")\n'
    from specdecode.errors import SpecDecodeError

    with pytest.raises(SpecDecodeError):
        exec(compile(code, "<doc example>", "exec"), {})


# --- the README's quick-start commands against the real CLI ------------------------------------------------


def quickstart_commands() -> list[list[str]]:
    block = README.read_text().split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True) for line in block.split("\n") if line.startswith("specdecode ")]


def test_quickstart_commands_parse_with_the_real_cli():
    from specdecode.cli import build_parser

    commands = quickstart_commands()
    assert len(commands) >= 3
    parser = build_parser()
    for argv in commands:
        parser.parse_args(argv[1:])
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "x", "--no-such-flag"])


@pytest.mark.parametrize("argv", quickstart_commands(), ids=lambda a: " ".join(a[1:3]))
def test_quickstart_commands_run(argv, tiny_dirs, shared_cache, tmp_path, monkeypatch, capsys):
    from specdecode.cli import main

    if "--prediction" in argv:
        (tmp_path / argv[argv.index("--prediction") + 1]).write_text("x = 1\nprint(x)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPECDECODE_CACHE", str(shared_cache))
    target, draft = tiny_dirs
    extra = ["--target", str(target), "--draft", str(draft)]
    if "--max-new-tokens" not in argv:
        extra += ["--max-new-tokens", "24"]
    assert main(argv[1:] + extra) == 0
    assert capsys.readouterr().out.strip()


# --- the command-line synopsis in the methods guide against the parser ---------------------------------------

SYNOPSIS_COMMANDS = ("generate", "index", "bench")
SYNOPSIS_OPTION = re.compile(r"(--[a-z][\w-]*)(?: ([^\s\[\]]+))?")


def synopses(text: str) -> dict[str, str]:
    """The synopsis block under "## Command line", one joined line per subcommand: {"generate": "...", ...}."""
    block = text.split("## Command line\n```\n", 1)[1].split("```", 1)[0]
    out: dict[str, str] = {}
    for line in block.split("\n"):
        if line.startswith("specdecode "):
            command = line.split()[1]
            out[command] = line
        elif line.strip():
            out[command] += " " + line.strip()
    return out


def parser_options(command: str) -> dict[str, argparse.Action]:
    from specdecode.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {
        o: a for a in sub.choices[command]._actions for o in a.option_strings if o.startswith("--") and o != "--help"
    }


def synopsis_problems(command: str, text: str) -> list[str]:
    """Options the synopsis leaves out or makes up, and `a|b|c` lists that differ from the parser's choices."""
    shown = dict(SYNOPSIS_OPTION.findall(synopses(text)[command]))
    options = parser_options(command)
    problems = [f"{command}: {o} missing" for o in options if o not in shown]
    problems += [f"{command}: {o} is not an option" for o in shown if o not in options]
    problems += [
        f"{command}: {o} {v} but the parser takes {'|'.join(map(str, options[o].choices))}"
        for o, v in shown.items()
        if o in options and options[o].choices and "|" in v and set(v.split("|")) != set(map(str, options[o].choices))
    ]
    return problems


@pytest.mark.parametrize("command", SYNOPSIS_COMMANDS)
def test_the_synopsis_in_the_methods_guide_matches_the_parser(command):
    assert synopsis_problems(command, (DOCS / "guide" / "methods.md").read_text()) == []


def test_the_synopsis_check_fails_on_a_missing_or_made_up_option():
    text = (DOCS / "guide" / "methods.md").read_text()
    assert synopsis_problems("generate", text.replace("[--exact]", "")) == ["generate: --exact missing"]
    assert synopsis_problems("index", text.replace("--out DIR", "--out DIR [--no-such]")) == [
        "index: --no-such is not an option"
    ]
    assert synopsis_problems("generate", text.replace("auto|torch|llama.cpp", "auto|torch"))
