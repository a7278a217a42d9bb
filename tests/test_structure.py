"""The seams: the LM and Drafter protocols, and a package without import cycles (imports inside
functions included)."""
import ast
from pathlib import Path

import specdecode
from specdecode.drafters import Drafter, DraftModel, PromptLookup
from specdecode.kv import LM, CachedLM
from specdecode.tree import TreeDrafter
from tiny import tiny_model
from tinygguf import write_tiny_gguf

SRC = Path(specdecode.__file__).parent


def test_backends_implement_the_lm_protocol(tmp_path):
    from specdecode.llamacpp import LlamaLM
    assert isinstance(CachedLM(tiny_model(0)), LM)
    assert isinstance(LlamaLM(write_tiny_gguf(tmp_path / "t.gguf", 0)), LM)
    assert not isinstance(tiny_model(0), LM)  # an HF model is wrapped (kv.as_lm), not used as one


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
                base = package[:len(package) - node.level + 1]
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
    modules = {".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in SRC.rglob("*.py")}
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
    assert "specdecode.tree" not in graph["specdecode.drafters"]  # a chain is a plain loop of draft passes
    assert graph["specdecode.engine"] >= {"specdecode.tree", "specdecode.drafters", "specdecode.verify"}
    assert "specdecode.models" in graph["specdecode.engine"]  # imported only inside Engine.load: read too
    assert graph["specdecode.machine"] == set()  # the leaf that costs, models and llamacpp share
