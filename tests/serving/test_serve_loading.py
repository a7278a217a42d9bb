"""`specdecode serve`'s model loading: --ctx-size on every engine of a router, and the options `--ray` passes to
its replicas or refuses (none dropped)."""

from __future__ import annotations

import pytest

from specdecode import routing
from specdecode.cli import build_parser, main
from specdecode.cli.serve import load_served
from specdecode.routing import Router
from tiny import build_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)


def two_engine_router(**kwargs) -> Router:
    r = Router.__new__(Router)  # two engines and no timing: what Router.load returns where torch joins
    r.engines = {"llama.cpp": build_engine(0, None), "torch": build_engine(0, None)}
    r.primary, r.read_s, r.choices = r.engines["llama.cpp"], {"llama.cpp": 0.1, "torch": 0.1}, {}
    return r


def test_ctx_size_limits_every_engine_of_a_router(monkeypatch):
    monkeypatch.setattr(routing.Router, "load", classmethod(lambda cls, *a, **kw: two_engine_router()))
    args = build_parser().parse_args(["serve", "--route", "--ctx-size", "40", "--method", "pld"])
    router, slots = load_served(args)
    assert slots is None and {n: e.target.max_length for n, e in router.engines.items()} == {
        "llama.cpp": 40,
        "torch": 40,
    }
    args = build_parser().parse_args(["serve", "--route", "--ctx-size", "100000", "--method", "pld"])
    with pytest.raises(routing.SpecDecodeError, match="more than the model's context"):
        load_served(args)


@pytest.fixture
def ray_calls(monkeypatch):
    """serve --ray's calls into ray_serve, recorded instead of starting Ray."""
    pytest.importorskip("ray")
    from specdecode.server import ray_serve

    calls = {}
    monkeypatch.setattr(ray_serve, "ray_app", lambda *a, **kw: calls.setdefault("ray_app", kw) and "app")
    monkeypatch.setattr(ray_serve, "run_ray", lambda *a: calls.setdefault("run_ray", a))
    return calls


def test_serve_ray_passes_speculation_sources_to_the_replicas(ray_calls):
    assert main(["serve", "--ray", "--method", "pld", "--speculation-sources", "--port", "0"]) == 0
    assert ray_calls["ray_app"]["show_sources"] is True
    ray_calls.clear()
    assert main(["serve", "--ray", "--method", "pld", "--port", "0"]) == 0
    assert ray_calls["ray_app"]["show_sources"] is False


def test_serve_ray_refuses_route(ray_calls, capsys):
    assert main(["serve", "--ray", "--route", "--method", "pld", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--route is not available inside Ray replicas" in err and not ray_calls
