"""What `--route` loads and measures: no torch engine in exact mode, and the bf16 probe cached per machine and
model, with a way to time it again."""

from __future__ import annotations

import pytest

from specdecode import routing
from specdecode.cli import build_parser
from specdecode.cli.load import load_kwargs
from specdecode.errors import SpecDecodeError
from specdecode.routing import Router
from tiny import build_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)


def test_route_in_exact_mode_loads_llama_cpp_alone(tmp_path, monkeypatch):
    """Exact mode keeps every request on llama.cpp (Router.open), so the torch copy would never run: not loaded."""
    from tinygguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "t.gguf", 0)
    monkeypatch.setenv("SPECDECODE_ROUTE_FORCE", "1")  # torch would join on any machine
    loads = []
    real = routing.Engine.load
    monkeypatch.setattr(routing.Engine, "load", lambda *a, **kw: loads.append(kw["backend"]) or real(*a, **kw))
    router = Router.load(str(gguf), None, progress=False, with_draft=False, exact=True)
    assert list(router.engines) == ["llama.cpp"] and loads == ["llama.cpp"]
    out = router.generate("hello hello", max_new_tokens=4)
    assert out.stats.engine == "llama.cpp" and len(out.token_ids) == 4


def test_the_probe_is_timed_once_per_machine_and_model_and_again_when_asked(monkeypatch):
    timed = []
    monkeypatch.setattr(routing, "flat_ratio", lambda: timed.append(1) or 2.5)
    monkeypatch.delenv("SPECDECODE_ROUTE_FORCE", raising=False)
    monkeypatch.setattr(routing, "memory_available", lambda: None)
    engine = build_engine(0, None)
    why = routing.torch_unsuited(engine)
    assert "2.5x" in why and len(timed) == 1
    assert routing.torch_unsuited(engine) == why and len(timed) == 1  # read from the cache directory
    assert routing.torch_unsuited(engine, remeasure=True) == why
    assert len(timed) == 2  # timed again when asked
    other = build_engine(3, None)  # another model: its own entry
    other.target.describe = lambda: "another model"
    routing.torch_unsuited(other)
    assert len(timed) == 3
    files = sorted(p.name for p in (routing.cache_dir() / "routing").glob("flat-*.json"))
    assert len(files) == 2


def test_remeasure_route_reaches_the_router_and_needs_route():
    parse = build_parser().parse_args
    assert load_kwargs(parse(["generate", "x", "--route", "--remeasure-route"]))["remeasure"] is True
    assert "remeasure" not in load_kwargs(parse(["generate", "x", "--route"]))
    with pytest.raises(SpecDecodeError, match="--remeasure-route goes with --route"):
        load_kwargs(parse(["serve", "--remeasure-route"]))


def test_the_router_reads_prompts_again_when_asked(monkeypatch):
    reads = []
    monkeypatch.setattr(routing, "read_seconds", lambda e, tokens, remeasure: reads.append(remeasure) or 0.01)
    engines = {"a": build_engine(0, None), "b": build_engine(0, None)}
    Router(engines)
    Router(engines, remeasure=True)
    assert reads == [False, False, True, True]
