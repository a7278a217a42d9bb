"""The seams: the LM and Drafter protocols, and a package without import cycles."""
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
    """specdecode modules imported at module level (imports inside functions are lazy, allowed)."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(SRC.parent).with_suffix("").parts[:-1])
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[:len(package.split(".")) - node.level + 1]
            mod = ".".join(base + ([node.module] if node.module else []))
            names = [mod] if node.module else [f"{mod}.{a.name}" for a in node.names]
            out.update(n for n in names if (SRC.parent / (n.replace(".", "/") + ".py")).is_file()
                       or (SRC.parent / n.replace(".", "/") / "__init__.py").is_file())
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
