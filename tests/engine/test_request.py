"""The typed request (request.py): Engine.stream's keywords are its fields, Engine.open runs it as stream() does,
and an Encoded request opens on another engine without tokenizing again."""

import dataclasses
import inspect

import pytest

from specdecode import Engine, SpecDecodeError
from specdecode.request import Encoded, Request

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)

OLD = "def add(a, b):\n    return a + b\n"


def test_the_request_holds_every_keyword_of_stream_and_is_frozen():
    keywords = {n for n, p in inspect.signature(Engine.stream).parameters.items() if p.kind is p.KEYWORD_ONLY}
    fields = {f.name for f in dataclasses.fields(Request)}
    assert fields - keywords == {"prompt", "engine"}  # the text, and a router's pinned engine
    assert keywords <= fields
    for f in dataclasses.fields(Request):  # the same defaults as stream()'s
        if f.name in keywords:
            assert inspect.signature(Engine.stream).parameters[f.name].default == f.default, f.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        Request("x").method = "pld"


@pytest.mark.parametrize("method", ["pld", "auto", "tree"])
def test_open_runs_the_request_as_stream_does(tiny_engine, method):
    kw = dict(method=method, max_new_tokens=16, prediction=OLD)
    opened = tiny_engine.open(Request("Rename add to plus:\n" + OLD, **kw)).run()
    streamed = tiny_engine.generate("Rename add to plus:\n" + OLD, **kw)
    assert opened.token_ids == streamed.token_ids and opened.stats.method == method
    assert opened.stats.accepted_prediction_tokens == streamed.stats.accepted_prediction_tokens


def test_an_encoded_request_opens_on_another_engine_without_tokenizing(tiny_engine, make_engine, monkeypatch):
    encoded = tiny_engine.encode_request(
        Request("Rename add to plus:\n" + OLD, method="pld", max_new_tokens=8, prediction=OLD)
    )
    assert isinstance(encoded, Encoded) and encoded.prediction_ids == tuple(tiny_engine.encode_prediction(OLD))
    other = make_engine()
    for name in ("encode", "encode_prediction"):
        monkeypatch.setattr(other, name, lambda *a, **kw: pytest.fail("tokenized again"))
    stream = other.open(encoded)
    assert stream.prompt_ids == encoded.prompt_ids and stream.prediction_ids == encoded.prediction_ids
    assert stream.run().token_ids == tiny_engine.open(encoded).run().token_ids


def test_a_request_is_checked_before_its_text_is_tokenized(tiny_engine, monkeypatch):
    monkeypatch.setattr(tiny_engine, "encode", lambda *a, **kw: pytest.fail("tokenized a refused request"))
    with pytest.raises(SpecDecodeError, match="unknown method"):
        tiny_engine.open(Request("x", method="nope"))
    with pytest.raises(SpecDecodeError, match="gamma"):
        tiny_engine.encode_request(Request("x", method="draft", gamma=0))
