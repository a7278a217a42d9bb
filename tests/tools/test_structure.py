"""The seams: the LM and Drafter protocols, backends behind the LM interface, and a package without
import cycles (imports inside functions included), with imports going down its layers only, and without oversized
modules."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import specdecode
from specdecode.backends import LM, CachedLM
from specdecode.drafters import Drafter, DraftModel, PromptLookup
from specdecode.planning.tree import TreeDrafter
from tiny import tiny_model
from tinygguf import write_tiny_gguf

SRC = Path(specdecode.__file__).parent


def test_backends_implement_the_lm_protocol(tmp_path):
    from specdecode.backends.llamacpp import LlamaLM

    assert isinstance(CachedLM(tiny_model(0)), LM)
    assert isinstance(LlamaLM(write_tiny_gguf(tmp_path / "t.gguf", 0)), LM)
    assert not isinstance(tiny_model(0), LM)  # an HF model is wrapped (backends.as_lm), not used as one


def test_what_differs_between_backends_is_a_member_of_the_lm(tmp_path):
    """Everything outside backends/ reads these instead of asking which backend it holds."""
    from specdecode.backends.llamacpp import MAX_SEQ, LlamaLM

    path = write_tiny_gguf(tmp_path / "t.gguf", 0)
    torch_lm, llama_lm = CachedLM(tiny_model(0)), LlamaLM(path, threads=1)
    assert torch_lm.tree_error() is None and llama_lm.tree_error() is None
    assert torch_lm.max_tree_nodes is None and llama_lm.max_tree_nodes == MAX_SEQ - 1 == 255
    assert torch_lm.gguf_path is None and llama_lm.gguf_path == path
    assert torch_lm.hf_model is torch_lm.model and llama_lm.hf_model is None
    assert torch_lm.quant_info is None and llama_lm.quant_info is None
    assert isinstance(torch_lm.threads, int) and llama_lm.threads == 1
    assert torch_lm.output_truncation_error() is None and "torch backend" in llama_lm.output_truncation_error()
    assert torch_lm.tolerances() == {"rollback": 1e-3, "tie": 1e-3}  # fp32
    assert llama_lm.tolerances() == {"rollback": 0.0, "tie": 0.5}  # rollbacks: bit for bit (LM.place_chain)


# outside backends/: no question of which backend an LM is (`backend` is a label for reports only)
ASKS_BACKEND = re.compile(r"backend\s*[!=]=|isinstance\([^)]*\b(LlamaLM|CachedLM)\b")
BACKENDS = ("specdecode.backends.llamacpp", "specdecode.backends.torch_lm")  # a backend: a module or a subpackage


def is_backend(module: str) -> bool:
    return any(module == b or module.startswith(b + ".") for b in BACKENDS)


def test_a_backend_is_its_module_or_any_module_of_its_subpackage():
    assert is_backend("specdecode.backends.llamacpp") and is_backend("specdecode.backends.llamacpp.batching")
    assert is_backend("specdecode.backends.torch_lm")
    assert not is_backend("specdecode.backends") and not is_backend("specdecode.backends.loading")


def test_nothing_outside_backends_asks_which_backend_it_holds():
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "backends":
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            assert not ASKS_BACKEND.search(line), f"{rel}:{lineno} asks which backend it holds: {line.strip()}"
        imports = _module_imports(path)
        direct = sorted(m for m in imports if is_backend(m))
        assert not direct, f"{rel} imports a backend directly: {direct}"
        if rel != Path("engine.py"):  # Engine.load loads models; everything else gets LMs
            assert "specdecode.backends.loading" not in imports, f"{rel} imports backends.loading"


def test_no_module_over_600_lines():
    """One concept per file; this only backstops a file that grew several (a file is never split to fit a number)."""
    for path in SRC.rglob("*.py"):
        n = len(path.read_text().splitlines())
        assert n <= 600, f"{path.relative_to(SRC)} has {n} lines: more than one concept?"


MAX_STATEMENT_LINES = 52  # a function fits a screen: counted in lines where a statement starts, which the
# formatter's line breaks (a signature or a call one argument per line) do not change


def statement_lines(node: ast.AST) -> int:
    return len({n.lineno for n in ast.walk(node) if isinstance(n, ast.stmt)})


def test_no_function_over_a_screen():
    long = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = statement_lines(node)
                if size > MAX_STATEMENT_LINES:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({size} statement lines)")
    assert not long, "split these functions: " + "; ".join(long)
    # the count is the formatter's invariant: the same function with its call broken one argument per line
    one = ast.parse("def f(a, b):\n    x = g(a, b)\n    return x\n").body[0]
    broken = ast.parse("def f(\n    a,\n    b,\n):\n    x = g(\n        a,\n        b,\n    )\n    return x\n").body[0]
    assert statement_lines(one) == statement_lines(broken) == 3


def test_drafters_implement_the_drafter_protocol():
    draft = DraftModel(tiny_model(1), 257)
    for d in (draft, PromptLookup(), TreeDrafter(draft), TreeDrafter(None)):
        assert isinstance(d, Drafter), type(d)


def _module_imports(path: Path) -> set[str]:
    """Every specdecode module `path` imports, anywhere in it: at module level and inside functions
    (a lazy import still ties the modules together), relative imports resolved against its package."""
    tree = ast.parse(path.read_text())
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    package = parts if parts[-1] == "__init__" else parts[:-1]  # the package a relative import starts from
    package = [p for p in package if p != "__init__"]

    def is_module(name: str) -> bool:
        f = SRC.parent / name.replace(".", "/")
        return f.with_suffix(".py").is_file() or (f / "__init__.py").is_file()

    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(list(base) + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import name`: the module pkg.name where there is one, else a name defined in pkg
            names = [f"{mod}.{a.name}" if is_module(f"{mod}.{a.name}") else mod for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] != SRC.name:
                continue
            while name and not is_module(name):  # `import specdecode.x.y` where y is not a module: x
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def test_no_import_cycles():
    modules = {
        ".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in SRC.rglob("*.py")
    }
    graph = {m: {i.removesuffix(".__init__") for i in _module_imports(p)} for m, p in modules.items()}
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for n in graph.get(m, ()):
            if n == m:
                continue
            assert state.get(n) != 1, "import cycle: " + " -> ".join(stack + [m, n])
            if n not in state:
                visit(n, stack + [m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])
    for m in graph:
        if m.startswith("specdecode.drafters"):  # a chain is a plain loop of draft passes
            assert "specdecode.planning.tree" not in graph[m], m
    assert graph["specdecode.engine"] >= {"specdecode.builders", "specdecode.drafters", "specdecode.loop"}
    assert graph["specdecode.builders"] >= {"specdecode.planning.tree", "specdecode.drafters"}  # the methods' drafters
    assert graph["specdecode.loop"] >= {"specdecode.verify", "specdecode.drafters", "specdecode.prefill"}
    assert "specdecode.backends.loading" in graph["specdecode.engine"]  # imported only inside Engine.load: read too
    host = {f"specdecode.host.{m}" for m in ("machine", "hugepages", "imports", "threads")}
    assert all(graph[m] == set() for m in host)  # leaves: any module (costs, loading, llamacpp) reads them, no cycle
    assert graph["specdecode.host"] <= host


# The package's layers, top first; everything else is the library, at the bottom. A module imports its own layer and
# those below it, never one above: the library knows no command, and nothing below the command line imports cli/.
LAYERS = (
    # the dispatch, the shared argument groups and generate, serve, index, certify; and the parsers of the commands
    # that live in their own package, which the dispatch registers
    (
        "command line",
        (
            "specdecode.cli",
            "specdecode.__main__",
            "specdecode.apply.cli",
            "specdecode.bench.cli",
            "specdecode.loadtest.cli",
        ),
    ),
    ("commands", ("specdecode.server", "specdecode.bench", "specdecode.loadtest", "specdecode.apply")),
    ("shared by commands", ("specdecode.launch",)),  # the servers bench and loadtest start, prompt files
)


def layer(module: str) -> int:
    """How high `module` sits: 0 the library, len(LAYERS) the command line."""
    for i, (_, tops) in enumerate(LAYERS):
        if any(module == t or module.startswith(t + ".") for t in tops):
            return len(LAYERS) - i
    return 0


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} imports {i}" for m, imports in graph.items() for i in imports if layer(i) > layer(m))


def test_the_layers_are_what_the_package_holds():
    assert (
        layer("specdecode.cli.serve")
        == layer("specdecode.cli.args")
        == layer("specdecode.bench.cli")
        > layer("specdecode.server.app")
        > layer("specdecode.launch.describe")
        > layer("specdecode.certify")
        == layer("specdecode.host.machine")
        == 0
    )
    assert layer("specdecode.bench.run") == layer("specdecode.loadtest.soak") == layer("specdecode.apply.client")
    upward = upward_imports({"specdecode.certify": {"specdecode.bench"}})
    assert upward == ["specdecode.certify imports specdecode.bench"]
    assert upward_imports({"specdecode.server.app": {"specdecode.cli.args"}}) == [
        "specdecode.server.app imports specdecode.cli.args"
    ]  # nothing below the command line imports cli/
    assert (
        upward_imports(
            {
                "specdecode.cli.serve": {"specdecode.server.app", "specdecode.engine"},
                "specdecode.bench.cli": {"specdecode.cli.args", "specdecode.bench.run"},
            }
        )
        == []
    )


def test_imports_go_down_the_layers():
    modules = {
        ".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in SRC.rglob("*.py")
    }
    graph = {m: {i.removesuffix(".__init__") for i in _module_imports(p)} for m, p in modules.items()}
    assert graph["specdecode.cli.dispatch"] >= {"specdecode.cli.serve", "specdecode.bench.cli"}  # the walk sees them
    assert upward_imports(graph) == []


@pytest.mark.process
def test_the_load_test_and_the_command_line_load_no_torch():
    """`specdecode loadtest` runs beside the servers it measures: its modules and launch/'s load no torch; nor do the
    package, the CLI module and every command's parser (the command restarts for huge pages before anything loads
    torch, and `--help` or a usage error takes no import of it), nor a request's checks (the command line runs them
    before a model loads) and the packages whose names load on first use. The engine, the negative control,
    does."""
    light = [
        "specdecode",
        "specdecode.cli",
        "specdecode.checks",
        "specdecode.params",
        "specdecode.methods",
        "specdecode.bench",
        "specdecode.bench.cli",
        "specdecode.backends",
        "specdecode.drafters",
        "specdecode.cli.args",
        "specdecode.cli.serve",
        "specdecode.cli.generate",
        "specdecode.cli.load",
    ] + [
        f"specdecode.{p.parent.name}.{p.stem}".removesuffix(".__init__")
        for d in ("loadtest", "launch")
        for p in sorted((SRC / d).glob("*.py"))
    ]
    assert "specdecode.loadtest.cli" in light
    code = (
        "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
        "    assert 'torch' not in sys.modules, m + ' loads torch'\n"
        "if 'specdecode.cli' in sys.modules:\n"
        "    sys.modules['specdecode.cli'].build_parser()  # every command's parser\n"
        "    assert 'torch' not in sys.modules, 'a parser loads torch'\n"
        "if 'specdecode.checks' in sys.modules:\n"
        "    sys.modules['specdecode.checks'].check_request(method='tree', temperature=0.7, top_p=0.9, "
        "stop=['x'], tree_width=2)\n    assert 'torch' not in sys.modules, 'check_request loads torch'\n"
    )
    for modules, loads_torch in ((light, False), (["specdecode.engine"], True)):
        out = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, timeout=300)
        assert (out.returncode != 0) == loads_torch, out.stderr[-2000:]


# A Stream's members that no other class of the package has: an assignment to one of them is an assignment to a Stream
STREAM_ONLY = {
    "cache_scope",
    "encoded",
    "prediction_ids",
    "prompt_ids",
    "reopen",
    "stop_when",
    "wrap_steps",
    "_interrupt",
}


def _names_a_stream(node: ast.expr) -> bool:
    """`stream`, `out_stream`, `job.stream`, `self.stream`: an expression whose last name says it holds a stream."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "stream" in name.lower()


def stream_attributes_set(source: str) -> list[str]:
    """Each place in `source` that sets an attribute on a Stream: `<a stream>.x = ...` (also augmented, annotated,
    unpacked), `<anything>.<a member only a Stream has> = ...`, and `setattr(<a stream>, ...)`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        for target in targets:
            for t in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                if isinstance(t, ast.Attribute) and (_names_a_stream(t.value) or t.attr in STREAM_ONLY):
                    found.append(f"{node.lineno}: {ast.unparse(t)}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
            and _names_a_stream(node.args[0])
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_stream_check_finds_attributes_set_from_outside():
    assert sorted(
        stream_attributes_set(
            "stream.steps = wrap(stream.steps)\njob.stream.interrupt = f\n"
            "out.prompt_ids, out.cache_scope = ids, scope\nsetattr(stream, 'reopen', f)\n"
            "s.encoded += 1\n"
        )
    ) == [
        "1: stream.steps",
        "2: job.stream.interrupt",
        "3: out.cache_scope",
        "3: out.prompt_ids",
        "4: setattr(stream, 'reopen', f)",
        "5: s.encoded",
    ]
    assert (
        stream_attributes_set(
            "job.stream = job.stream.reopen(engine)\nstream.stats.engine = name\n"
            "self.engine = engine\nstream.wrap_steps(f)\n"
        )
        == []
    )


def test_nothing_outside_the_stream_class_sets_an_attribute_on_a_stream():
    """The Stream (textstream.TextStream) declares what it carries (__slots__: nothing else can be set on one) and
    changes only through its own methods (reopen, wrap_steps, stop_when); no module sets its attributes from outside."""
    from specdecode.stats import Stats
    from specdecode.textstream import TextStream

    assert not hasattr(TextStream(None, iter(()), Stats(), []), "__dict__")
    members = {n for n, v in vars(TextStream).items() if not n.startswith("__")} | set(TextStream.__slots__)
    assert STREAM_ONLY <= members
    found = {
        str(path.relative_to(SRC)): stream_attributes_set(path.read_text())
        for path in SRC.rglob("*.py")
        if path.name != "textstream.py"
    }
    assert {path: lines for path, lines in found.items() if lines} == {}
