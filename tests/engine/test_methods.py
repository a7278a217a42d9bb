"""The method table (specdecode.methods): one entry per method says what it needs and builds its drafter;
the Engine, CLI, server and bench read it."""

import argparse
import dataclasses

import pytest

from specdecode import METHODS, Engine, SpecDecodeError, bench, builders, methods
from specdecode.drafters import PromptLookup
from specdecode.methods import METHOD_TABLE, NO, OPTIONAL, REQUIRED, DraftRequest, Method


def test_the_table_covers_every_method_in_order():
    assert tuple(METHOD_TABLE) == METHODS == ("auto", "autoregressive", "draft", "lookup", "pld", "tree")
    for name, m in METHOD_TABLE.items():
        assert m.name == name and m.summary and "\n" not in m.summary and "%" not in m.summary
        assert m.needs_draft_model in (REQUIRED, OPTIONAL, NO)
        assert dataclasses.is_dataclass(m) and type(m).__dataclass_params__.frozen
        assert m.drafts == (m.build is not None)
        assert not m.chain or (m.uses_gamma and not m.planned and not m.tree_options)
        assert not m.planned or m.uses_cost_model
        assert m.build is None or (callable(m.build) and m.build.__module__ == "specdecode.builders")
    assert methods.BASELINE in METHOD_TABLE and not METHOD_TABLE[methods.BASELINE].drafts
    assert methods.DEFAULT_METHOD in METHOD_TABLE


def test_what_each_method_needs():
    """The facts the string tuples used to spell out, now read from the table."""
    assert methods.names_where(needs_draft_model=REQUIRED) == ["draft"]
    assert [n for n in METHODS if methods.wants_draft_model([n])] == ["auto", "draft", "tree"]
    assert methods.names_where(uses_cost_model=True) == ["auto", "lookup", "tree"]
    assert methods.names_where(planned=True) == ["auto", "lookup", "tree"]
    assert methods.names_where(uses_lookup_sources=True) == ["auto", "lookup", "tree"]
    assert methods.names_where(chain=True) == methods.names_where(uses_gamma=True) == ["draft", "pld"]
    assert methods.names_where(tree_options=True) == ["tree"]
    assert methods.names_where(drafts=True) == ["auto", "draft", "lookup", "pld", "tree"]
    assert methods.in_default_run("bench_default") == ["autoregressive", "auto", "pld", "draft"]
    assert methods.in_default_run("certify_default") == ["draft", "pld", "tree", "auto"]


def test_unknown_method_is_one_clear_error():
    for bad in ("nope", None, ["draft"]):
        with pytest.raises(SpecDecodeError, match="unknown method .*choose one of auto, autoregressive"):
            Engine.check(method=bad)


def _choices(parser, command, option):
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return next(a for a in sub._actions if option in a.option_strings)


def test_cli_choices_and_help_come_from_the_table():
    from specdecode.cli import build_parser

    parser = build_parser()
    for command in ("generate", "serve"):
        action = _choices(parser, command, "--method")
        assert tuple(action.choices) == tuple(METHOD_TABLE) and action.default == methods.DEFAULT_METHOD
    assert all(m.summary in _choices(parser, "generate", "--method").help for m in METHOD_TABLE.values())
    assert all(n in _choices(parser, "bench", "--methods").help for n in METHOD_TABLE)
    assert _choices(parser, "certify", "--methods").default == "draft,pld,tree,auto"


def test_server_openapi_method_enum_comes_from_the_table(tiny_engine):
    pytest.importorskip("fastapi")
    from specdecode.server import create_app

    app = create_app(tiny_engine, model_id="tiny", method="pld", gamma=2)
    try:
        doc = app.openapi()
    finally:
        app.state.worker.stop()
    method = doc["components"]["schemas"]["Speculation"]["properties"]["method"]
    assert method["anyOf"][0]["enum"] == list(METHOD_TABLE)
    assert all(m.summary in method["description"] for m in METHOD_TABLE.values())


def test_bench_methods_come_from_the_table(tiny_engine):
    assert bench.BENCH_METHODS[: len(METHODS)] == tuple(METHOD_TABLE)
    assert bench.default_methods(tiny_engine) == ["autoregressive", "auto", "pld", "draft", "hf-assisted"]
    no_draft = Engine(tiny_engine.target, tiny_engine.tokenizer)
    assert bench.default_methods(no_draft) == ["autoregressive", "auto", "pld"]
    with pytest.raises(SpecDecodeError, match="method draft needs a draft model"):
        bench.check_methods(no_draft, ["autoregressive", "draft"])
    with pytest.raises(SpecDecodeError, match="methods draft and hf-assisted need a draft model"):
        bench.check_methods(no_draft, ["hf-assisted", "draft"])
    assert bench.needs_draft_model(["autoregressive", "tree"]) and bench.needs_draft_model(["hf-assisted"])
    assert not bench.needs_draft_model(["autoregressive", "pld", "lookup"])
    assert bench.parse_methods("pld") == ["autoregressive", "pld"]


FAKE = Method(
    "fake",
    "a test's method: prompt lookup under another name",
    uses_gamma=True,
    chain=True,
    build=lambda parts, request: PromptLookup(),
)


def test_a_method_added_to_the_table_is_accepted_and_builds_its_drafter(monkeypatch, make_engine):
    monkeypatch.setitem(METHOD_TABLE, "fake", FAKE)
    Engine.check(method="fake", gamma=3)  # accepted
    with pytest.raises(SpecDecodeError, match="tree_width applies to method 'tree' only"):
        Engine.check(method="fake", tree_width=2)
    engine = make_engine(draft=None)
    assert isinstance(engine.drafter("fake", DraftRequest(3, Engine.check(method="fake"))), PromptLookup)
    out = engine.generate("abcabcabcabc", method="fake", gamma=3, max_new_tokens=12)
    plain = engine.generate("abcabcabcabc", method="autoregressive", max_new_tokens=12)
    assert out.token_ids == plain.token_ids  # lossless, as its drafter is
    assert out.stats.method == "fake" and out.stats.gamma == 3 and out.stats.drafted > 0
    # a built-in builder named by the table builds it too, from the engine's parts
    monkeypatch.setitem(METHOD_TABLE, "fake", dataclasses.replace(FAKE, build=builders.build_pld))
    assert isinstance(engine.drafter("fake", DraftRequest(3, Engine.check(method="fake"))), PromptLookup)


def test_a_method_added_to_the_table_reaches_bench_summaries(monkeypatch):
    """bench's summary reads the table's flags: a chain method gets alpha and the analytic bound."""
    monkeypatch.setitem(METHOD_TABLE, "fake", FAKE)
    assert bench.has_flag("fake", "chain") and not bench.has_flag("hf-assisted", "chain")


def test_the_table_says_which_methods_a_router_may_move():
    """A router moves only the methods the table marks routable, none that needs a draft model."""
    assert methods.names_where(routable=True) == ["auto", "autoregressive", "lookup", "pld"]
    assert all(METHOD_TABLE[n].needs_draft_model != REQUIRED for n in methods.names_where(routable=True))
