"""The OpenAI-compatible server, against live uvicorn servers on 127.0.0.1 around tiny engines."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import hypothesis
import openai
import pytest
import schemathesis
from prometheus_client.parser import text_string_to_metric_families
from schemathesis.specs.openapi.checks import positive_data_acceptance

from helpers import LiveServer, http
from specdecode import METHODS, Engine, SpecDecodeError
from specdecode.cli import main
from specdecode.errors import ContextExceeded, EngineUnavailable
from specdecode.server import create_app, engine_lock
from tiny import build_engine, byte_tokenizer

MODEL = "tiny"
KEY = "sk-test-0123456789"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)


# one cache for this module's servers (conftest): no test here replaces a measurement, so what it holds is what
# measuring gives (the measurement itself: test_context_costs.py and the start-up test below)
SHARED_CACHE = True


@pytest.fixture(scope="module")
def live(tiny_engine):
    srv = LiveServer(create_app(tiny_engine, model_id=MODEL, method="draft", gamma=3))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


def reference(live, engine, prompt, **kw):
    """engine.generate while the server's worker is idle (the Engine is not thread-safe)."""
    live.wait_idle()
    with engine_lock(engine):
        return engine.generate(prompt, **kw)


def metrics(url) -> dict:
    text = http.get(f"{url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(m, name, **labels):
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


# -- the official client ---------------------------------------------------------------------------------------------
def test_models_and_health(live, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    h = http.get(f"{live.url}/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL


@pytest.mark.parametrize("method", ["draft", "pld", "autoregressive", "tree"])
def test_completion_greedy_equals_engine(live, client, tiny_engine, method):
    ref = reference(live, tiny_engine, "hello world", method=method, gamma=3, max_new_tokens=24)
    out = client.completions.create(
        model=MODEL,
        prompt="hello world",
        max_tokens=24,
        temperature=0,
        extra_body={"speculation": {"method": method, "gamma": 3}},
    )
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ("length" if ref.stats.finish_reason == "length" else "stop")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (ref.stats.prompt_tokens, ref.stats.new_tokens)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    spec = out.model_extra["speculation"]
    assert spec["method"] == method and spec["new_tokens"] == ref.stats.new_tokens
    if method != "tree":  # a greedy tree's shape follows what the engine learned so far; its text does not
        assert spec["drafted"] == ref.stats.drafted and spec["accepted"] == ref.stats.accepted

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="hello world",
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"speculation": {"method": method, "gamma": 3}},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == out.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == ref.stats.new_tokens


def test_chat_greedy_equals_engine_and_server_default_method(live, client, tiny_engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    ref = reference(live, tiny_engine, messages, method="draft", gamma=3, max_new_tokens=20)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == ref.stats.prompt_tokens
    assert out.model_extra["speculation"]["method"] == "draft"  # the server's default
    assert out.model_extra["speculation"]["gamma"] == 3

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == out.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_raw_stream_format_and_stop_strings(live, tiny_engine):
    ref = reference(live, tiny_engine, "abcabc", method="pld", gamma=3, max_new_tokens=40)
    stop = ref.text[5:7]
    assert stop
    ref_stop = reference(live, tiny_engine, "abcabc", method="pld", gamma=3, max_new_tokens=40, stop=[stop])
    body = {
        "model": MODEL,
        "prompt": "abcabc",
        "max_tokens": 40,
        "stop": stop,
        "stream": True,
        "speculation": {"method": "pld"},
    }
    with http.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref_stop.text and stop not in ref_stop.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["speculation"]["finish_reason"] == "stop"


def test_sampling_with_seed_is_reproducible(live, client, tiny_engine):
    kw = dict(model=MODEL, prompt="xyz", max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    ref = reference(
        live, tiny_engine, "xyz", method="draft", gamma=3, max_new_tokens=16, temperature=0.9, top_p=0.95, seed=7
    )
    assert a == b == ref.text


def test_vanishing_temperature_and_top_p_mean_greedy(live, tiny_engine):
    """Below float32's range they used to reach the engine as 0 and give nan probabilities (a 500)."""
    ref = reference(live, tiny_engine, "abc", method="autoregressive", max_new_tokens=8)
    for extra in ({"temperature": 5e-324}, {"temperature": 1.0, "top_p": 5e-324}):
        r = http.post(
            f"{live.url}/v1/completions",
            json={
                "model": MODEL,
                "prompt": "abc",
                "max_tokens": 8,
                "speculation": {"method": "autoregressive"},
                **extra,
            },
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text


def test_exact_request_is_plain_decodings_output(live, tiny_engine):
    ref = reference(live, tiny_engine, "abcabcabc", method="autoregressive", max_new_tokens=12)
    for method in ("draft", "tree"):
        r = http.post(
            f"{live.url}/v1/completions",
            json={
                "model": MODEL,
                "prompt": "abcabcabc",
                "max_tokens": 12,
                "speculation": {"method": method, "exact": True},
            },
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text


# -- bad input: a 4xx with an OpenAI error body, and the server keeps serving ----------------------------------------
GOOD = {"model": MODEL, "prompt": "ok", "max_tokens": 2, "speculation": {"method": "autoregressive"}}
BAD = [
    ("completions", b"{not json", 400, "invalid_json", None),
    ("completions", b"", 400, None, None),
    ("completions", b"[1, 2]", 400, None, None),
    ("completions", b'"a string"', 400, None, None),
    ("completions", {"prompt": "hi"}, 400, "missing_field", "model"),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found", "model"),
    ("completions", {"model": MODEL}, 400, "missing_field", "prompt"),
    ("completions", {"model": MODEL, "prompt": ""}, 400, None, "prompt"),
    ("completions", {"model": MODEL, "prompt": 42}, 400, None, "prompt"),
    ("completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, None, "prompt"),
    ("completions", {"model": 7, "prompt": "hi"}, 400, None, "model"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": -5}, 400, None, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, None, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**12}, 400, None, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": "8"}, 400, None, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2.5}, 400, None, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": True}, 400, None, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "a" * 600}, 400, "context_length_exceeded", "prompt"),
    (
        "completions",
        {"model": MODEL, "prompt": "a" * 500, "max_tokens": 100},
        400,
        "context_length_exceeded",
        "max_tokens",
    ),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": -0.1}, 400, None, "temperature"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": 2.5}, 400, None, "temperature"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, None, "temperature"),
    ("completions", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, None, "temperature"),
    ("completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, None, "top_p"),
    ("completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, None, "top_p"),
    ("completions", {"model": MODEL, "prompt": "hi", "n": 2}, 400, None, "n"),
    ("completions", {"model": MODEL, "prompt": "hi", "stop": ""}, 400, None, "stop"),
    ("completions", {"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, None, "stop"),
    ("completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, None, "stream"),
    ("completions", {"model": MODEL, "prompt": "hi", "seed": 1.5}, 400, None, "seed"),
    (
        "completions",
        {"model": MODEL, "prompt": "hi", "speculation": {"method": "magic"}},
        400,
        None,
        "speculation.method",
    ),
    ("completions", {"model": MODEL, "prompt": "hi", "speculation": {"gamma": 0}}, 400, None, "speculation.gamma"),
    (
        "completions",
        {"model": MODEL, "prompt": "hi", "temperature": 0.7, "speculation": {"exact": True}},
        400,
        None,
        "speculation.exact",
    ),
    ("completions", {"model": MODEL, "prompt": "hi", "speculation": {"exact": "yes"}}, 400, None, "speculation.exact"),
    ("completions", {"model": MODEL, "prompt": "hi", "speculation": {"gamma": 1000}}, 400, None, "speculation.gamma"),
    ("completions", {"model": MODEL, "prompt": "hi", "speculation": {"draft": True}}, 400, None, "speculation.draft"),
    (
        "completions",
        {"model": MODEL, "prompt": "hi", "speculation": {"method": "tree", "tree_width": 0}},
        400,
        None,
        "speculation.tree_width",
    ),
    (
        "completions",
        {"model": MODEL, "prompt": "hi", "speculation": {"method": "tree", "tree_width": 17}},
        400,
        None,
        "speculation.tree_width",
    ),  # over the server's cap: what can pay
    (
        "completions",
        {"model": MODEL, "prompt": "hi", "speculation": {"method": "tree", "tree_nodes": 129}},
        400,
        None,
        "speculation.tree_nodes",
    ),
    (
        "completions",
        {"model": MODEL, "prompt": "hi", "speculation": {"method": "pld", "tree_depth": 2}},
        400,
        None,
        "speculation.tree_depth",
    ),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, None, "messages"),
    ("chat/completions", {"model": MODEL, "messages": "hi"}, 400, None, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400, None, "messages.0.content"),
    (
        "chat/completions",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        None,
        "messages.0.role",
    ),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "   "}]}, 400, None, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3}, 400, None, "n"),
    (
        "chat/completions",
        {"model": "other", "messages": [{"role": "user", "content": "hi"}]},
        404,
        "model_not_found",
        "model",
    ),
    (
        "chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "a" * 600}]},
        400,
        "context_length_exceeded",
        "messages",
    ),
]


@pytest.mark.parametrize("path, body, status, code, param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_gets_openai_error_then_server_still_serves(live, path, body, status, code, param):
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = http.post(f"{live.url}/v1/{path}", timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    good = http.post(f"{live.url}/v1/completions", json=GOOD, timeout=60)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


# The Engine is the one validation layer: the server's 400 carries the Engine's own message.
ENGINE_CHECKED = [
    ({"temperature": -0.1}, dict(temperature=-0.1), "temperature"),
    ({"top_p": 0}, dict(top_p=0.0), "top_p"),  # JSON numbers arrive as floats
    ({"top_k": -1}, dict(top_k=-1), "top_k"),
    ({"stop": ""}, dict(stop=""), "stop"),
    ({"stop": ["ok", ""]}, dict(stop=["ok", ""]), "stop"),
    ({"stop": ["x" * 5000]}, dict(stop=["x" * 5000]), "stop"),  # over the cap on stop strings' length
    ({"prompt": ""}, dict(prompt=""), "prompt"),
    ({"speculation": {"method": "draft", "gamma": 0}}, dict(method="draft", gamma=0), "speculation.gamma"),
    ({"speculation": {"method": "pld", "gamma": -3}}, dict(method="pld", gamma=-3), "speculation.gamma"),
    ({"speculation": {"method": "tree", "tree_nodes": 0}}, dict(method="tree", tree_nodes=0), "speculation.tree_nodes"),
    ({"speculation": {"method": "pld", "tree_width": 2}}, dict(method="pld", tree_width=2), "speculation.tree_width"),
]


@pytest.mark.parametrize("fields, kwargs, param", ENGINE_CHECKED, ids=[c[2] for c in ENGINE_CHECKED])
def test_bad_values_get_the_engines_message(live, tiny_engine, fields, kwargs, param):
    kwargs = {"prompt": "hi", "method": "draft", "gamma": 3, **kwargs}
    with pytest.raises(SpecDecodeError) as e:
        tiny_engine.stream(kwargs.pop("prompt"), **kwargs)
    r = http.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": "hi", **fields}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": str(e.value),
        "type": "invalid_request_error",
        "param": param,
        "code": "invalid_value",
    }


def test_chat_messages_errors_are_the_engines(live, tiny_engine):
    with pytest.raises(SpecDecodeError) as e:
        tiny_engine.stream([{"role": "user", "content": "  "}])
    r = http.post(
        f"{live.url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "  "}]}
    )
    assert r.status_code == 400 and r.json()["error"]["message"] == str(e.value)
    assert r.json()["error"]["param"] == "messages"


ROLE_ORDER_TEMPLATE = (  # as templates that check the conversation do (Llama 2's, Mistral's)
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_chat_template_error_and_a_lone_surrogate_are_the_clients_400():
    tok = byte_tokenizer()
    tok.chat_template = ROLE_ORDER_TEMPLATE
    srv = LiveServer(create_app(build_engine(tokenizer=tok), model_id=MODEL, method="pld", gamma=2))
    try:
        url = f"{srv.url}/v1/chat/completions"
        for stream in (False, True):
            body = {
                "model": MODEL,
                "max_tokens": 2,
                "stream": stream,
                "messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}],
            }
            r = http.post(url, json=body, timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert "Conversation roles must alternate" in err["message"] and err["param"] == "messages"
            assert err["type"] == "invalid_request_error"
        ok = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
        assert http.post(url, json=ok, timeout=60).status_code == 200  # the template itself works
        raw = (
            b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}',
            b'{"model": "tiny", "max_tokens": 2, "prompt": "a\\udc00"}',
        )
        for path, body in zip(("chat/completions", "completions"), raw):
            r = http.post(
                f"{srv.url}/v1/{path}", content=body, headers={"content-type": "application/json"}, timeout=60
            )
            assert r.status_code == 400, r.text
            assert "surrogate" in r.json()["error"]["message"]
            assert r.json()["error"]["param"] == ("messages" if path == "chat/completions" else "prompt")
        paired = b'{"model": "tiny", "max_tokens": 2, "prompt": "a\\ud83d\\ude00"}'  # a pair is one character
        assert (
            http.post(
                f"{srv.url}/v1/completions", content=paired, headers={"content-type": "application/json"}, timeout=60
            ).status_code
            == 200
        )
    finally:
        srv.stop()


UNSUPPORTED_FIELDS = [
    ("completions", {"logprobs": 2}, "logprobs"),
    ("chat/completions", {"logprobs": True}, "logprobs"),
    ("chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("completions", {"logit_bias": {"50": 100}}, "logit_bias"),
    ("completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("chat/completions", {"frequency_penalty": -1}, "frequency_penalty"),
    ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"suffix": "}"}, "suffix"),
]


@pytest.mark.parametrize("path, fields, param", UNSUPPORTED_FIELDS, ids=[f[2] for f in UNSUPPORTED_FIELDS])
def test_unsupported_openai_fields_get_a_400(live, path, fields, param):
    body = {"model": MODEL, "max_tokens": 2, **fields}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if path.startswith("chat") else {"prompt": "hi"})
    r = http.post(f"{live.url}/v1/{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "unsupported_parameter" and "not supported" in err["message"]


def test_fields_that_ask_for_nothing_are_accepted(live, client):
    harmless = {
        "logprobs": False,
        "top_logprobs": 0,
        "logit_bias": {},
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "n": 1,
        "user": "someone",
        "store": False,
        "metadata": {"a": "b"},
    }
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_body=harmless
    )
    assert 1 <= out.usage.completion_tokens <= 3
    r = http.post(
        f"{live.url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": "hi",
            "max_tokens": 2,
            "echo": False,
            "best_of": 1,
            "logprobs": None,
            "suffix": None,
        },
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("chat, stream", [(False, False), (True, False), (False, True), (True, True)])
def test_the_prompt_is_tokenized_once(live, tiny_engine, monkeypatch, chat, stream):
    calls = []
    encode = tiny_engine.encode

    def counting(*args, **kw):
        calls.append(args)
        return encode(*args, **kw)

    live.wait_idle()
    monkeypatch.setattr(tiny_engine, "encode", counting)
    body = {"model": MODEL, "max_tokens": 4, "stream": stream}
    body.update({"messages": [{"role": "user", "content": "once"}]} if chat else {"prompt": "once"})
    r = http.post(f"{live.url}/v1/{'chat/completions' if chat else 'completions'}", json=body, timeout=60)
    assert r.status_code == 200 and len(calls) == 1


def test_a_queued_stream_gets_its_headers_at_once_and_keepalives():
    ctl = ControlledEngine(build_engine())
    srv = LiveServer(create_app(ctl, model_id=MODEL, method="autoregressive", gamma=1, keepalive_s=0.2))
    try:
        ctl.gate.clear()
        results = {}
        a = _post_in_thread(
            f"{srv.url}/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 4}, results, "a"
        )
        wait_for(lambda: srv.worker.busy)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 6, "stream": True}
        with http.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert srv.worker.queued == 1  # the headers came while the request waits
            lines = r.iter_lines()
            first = json.loads(next(lines)[6:])  # the role comes at once too
            assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            comments = 0
            for line in lines:
                if line == ": keep-alive":
                    comments += 1
                    if comments == 3:
                        break
            assert srv.worker.queued == 1
            ctl.gate.set()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in rest)
        text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "") for line in rest[:-1])
        a.join(60)
        with engine_lock(ctl._engine):
            ref = ctl._engine.generate([{"role": "user", "content": "abc"}], method="autoregressive", max_new_tokens=6)
        assert text == ref.text
    finally:
        ctl.gate.set()
        srv.stop()


def test_unknown_route_and_method(live):
    r = http.get(f"{live.url}/v1/engines")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = http.get(f"{live.url}/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_official_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"


# -- API key ---------------------------------------------------------------------------------------------------------
def test_api_key(tiny_engine):
    srv = LiveServer(create_app(tiny_engine, model_id=MODEL, method="pld", gamma=2, api_key=KEY))
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
            r = http.post(f"{srv.url}/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        r = http.post(f"{srv.url}/v1/completions", content=b"{bad json", headers={"content-type": "application/json"})
        assert r.status_code == 401  # the key is checked before the body is read
        assert http.get(f"{srv.url}/v1/models").status_code == 401
        ok = http.post(f"{srv.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
        assert http.get(f"{srv.url}/health").status_code == 200 and http.get(f"{srv.url}/metrics").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="nope", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
        assert (
            good.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3
            ).usage.completion_tokens
            >= 1
        )
        m = metrics(srv.url)
        assert metric(m, "specdecode_requests_total", route="/v1/completions", status="401") == 5
        assert metric(m, "specdecode_requests_total", route="/v1/completions", status="200") == 1
    finally:
        srv.stop()


@pytest.mark.parametrize("how", ["mount", "root_path"])
def test_api_key_under_a_path_prefix(tiny_engine, how):
    """Under a path prefix (a Starlette Mount, uvicorn's --root-path) the request's path is /prefix/v1/...
    while routing still matches /v1/...: the key is checked on the route that matched."""
    app = create_app(tiny_engine, model_id=MODEL, method="pld", gamma=2, api_key=KEY)
    if how == "mount":
        from starlette.applications import Starlette
        from starlette.routing import Mount

        srv = LiveServer(Starlette(routes=[Mount("/prefix", app=app)]))
        base = f"{srv.url}/prefix"
    else:  # a proxy that strips the prefix before uvicorn; the app is told it through root_path
        srv = LiveServer(app, root_path="/prefix")
        base = srv.url
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = http.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            assert http.get(f"{base}/v1/models", headers=headers).status_code == 401
            assert http.get(f"{base}/v1/models/{MODEL}", headers=headers).status_code == 401
        r = http.post(f"{base}/v1/completions", content=b"{bad json", headers={"content-type": "application/json"})
        assert r.status_code == 401  # before the body is read
        good = {"Authorization": f"Bearer {KEY}"}  # the same routes with the key: they are reachable
        assert http.get(f"{base}/v1/models", headers=good).json()["data"][0]["id"] == MODEL
        ok = http.post(f"{base}/v1/completions", json=body, headers=good, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        assert http.get(f"{base}/health").status_code == 200
    finally:
        srv.stop()


# -- concurrency -----------------------------------------------------------------------------------------------------
def test_parallel_requests_all_get_the_sequential_answer(live, tiny_engine):
    jobs = []
    for i in range(8):
        prompt = f"prompt number {i}:"
        chat, stream = i % 2 == 1, i % 4 >= 2
        jobs.append((prompt, chat, stream))
    refs = [
        reference(
            live,
            tiny_engine,
            [{"role": "user", "content": p}] if chat else p,
            method="draft",
            gamma=3,
            max_new_tokens=12,
        ).text
        for p, chat, _ in jobs
    ]

    def ask(job):
        prompt, chat, stream = job
        body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        url = f"{live.url}/v1/{'chat/completions' if chat else 'completions'}"
        if not stream:
            r = http.post(url, json=body, timeout=120)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            return c["message"]["content"] if chat else c["text"]
        text = ""
        with http.stream("POST", url, json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    c = json.loads(line[6:])["choices"][0]
                    text += (c["delta"].get("content") or "") if chat else c["text"]
        return text

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, jobs))
    assert answers == refs


class ControlledEngine:
    """An Engine whose generations wait for `gate` before their first delta and sleep `delay` per delta."""

    def __init__(self, engine, delay=0.0):
        self._engine, self.delay = engine, delay
        self.gate = threading.Event()
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def open(self, request):
        return _ControlledStream(self._engine.open(request), self)


class _ControlledStream:
    def __init__(self, inner, ctl):
        self.inner, self.ctl = inner, ctl

    def __getattr__(self, name):  # the stream's other members (prediction_ids, stop_when, ...)
        return getattr(self.inner, name)

    @property
    def stats(self):
        return self.inner.stats

    @property
    def result(self):
        return self.inner.result

    def __iter__(self):
        assert self.ctl.gate.wait(60)
        for delta in self.inner:
            yield delta
            time.sleep(self.ctl.delay)


def _post_in_thread(url, body, results, key):
    def run():
        try:
            results[key] = http.post(url, json=body, timeout=120)
        except Exception as e:  # noqa: BLE001
            results[key] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def wait_for(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


def test_queue_full_gives_503_with_retry_after():
    ctl = ControlledEngine(build_engine())
    srv = LiveServer(create_app(ctl, model_id=MODEL, method="autoregressive", gamma=1, max_queue=1))
    try:
        url = f"{srv.url}/v1/completions"
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 4}
        ctl.gate.clear()
        results = {}
        a = _post_in_thread(url, body, results, "a")  # generating, held at the gate
        wait_for(lambda: srv.worker.busy)
        b = _post_in_thread(url, body, results, "b")  # waiting in the queue
        wait_for(lambda: srv.worker.queued == 1)
        r = http.post(url, json=body)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        assert http.get(f"{srv.url}/health").json() == {"status": "ok", "model": MODEL, "busy": True, "queued": 1}
        ctl.gate.set()
        a.join(60), b.join(60)
        assert results["a"].status_code == results["b"].status_code == 200
        assert results["a"].json()["choices"][0]["text"] == results["b"].json()["choices"][0]["text"]
        assert http.post(url, json=body).status_code == 200
    finally:
        ctl.gate.set()
        srv.stop()


def test_disconnect_mid_stream_stops_generation_and_frees_the_worker():
    ctl = ControlledEngine(build_engine(), delay=0.01)
    srv = LiveServer(create_app(ctl, model_id=MODEL, method="draft", gamma=3, max_queue=1))
    try:
        body = {"model": MODEL, "prompt": "go on and on", "max_tokens": 400, "stream": True}
        with http.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert srv.worker.busy
        t0 = time.monotonic()
        srv.wait_idle(20)
        assert time.monotonic() - t0 < 5  # far less than 400 tokens at >= 10 ms each
        m = metrics(srv.url)
        assert metric(m, "specdecode_generations_total", finish_reason="cancelled") == 1
        assert 0 < metric(m, "specdecode_generated_tokens_total") < 400
        assert metric(m, "specdecode_worker_busy") == 0 and metric(m, "specdecode_queue_depth") == 0
        ok = http.post(f"{srv.url}/v1/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    finally:
        srv.stop()


def test_disconnect_while_queued_frees_the_place():
    ctl = ControlledEngine(build_engine())
    srv = LiveServer(create_app(ctl, model_id=MODEL, method="pld", gamma=2, max_queue=1))
    try:
        url = f"{srv.url}/v1/completions"
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 3}
        ctl.gate.clear()
        results = {}
        a = _post_in_thread(url, body, results, "a")
        wait_for(lambda: srv.worker.busy)
        with httpx.Client(timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
            c.post(url, json=body)  # waits in the queue, then its client gives up
        wait_for(lambda: srv.worker.queued == 0, timeout=10)  # the place is free again
        b = _post_in_thread(url, body, results, "b")
        wait_for(lambda: srv.worker.queued == 1)
        ctl.gate.set()
        a.join(60), b.join(60)
        assert results["a"].status_code == results["b"].status_code == 200
        srv.wait_idle()
        m = metrics(srv.url)
        assert metric(m, "specdecode_requests_total", route="/v1/completions", status="499") == 1
        assert metric(m, "specdecode_generations_total", finish_reason="length") == 2
    finally:
        ctl.gate.set()
        srv.stop()


def test_timeouts():
    ctl = ControlledEngine(build_engine(), delay=0.02)
    srv = LiveServer(create_app(ctl, model_id=MODEL, method="autoregressive", gamma=1, timeout_s=0.6))
    try:
        url = f"{srv.url}/v1/completions"
        r = http.post(url, json={"model": MODEL, "prompt": "abc", "max_tokens": 300}, timeout=60)
        assert r.status_code == 200
        out = r.json()
        assert out["choices"][0]["finish_reason"] == "length" and out["speculation"]["finish_reason"] == "timeout"
        assert 0 < out["usage"]["completion_tokens"] < 300

        ctl.gate.clear()  # the next request holds the worker; the one after it times out in the queue
        results = {}
        a = _post_in_thread(url, {"model": MODEL, "prompt": "abc", "max_tokens": 2}, results, "a")
        wait_for(lambda: srv.worker.busy)
        r = http.post(url, json={"model": MODEL, "prompt": "abc", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "timeout" and "retry-after" in r.headers
        ctl.gate.set()
        a.join(60)
        assert results["a"].status_code == 200
        m = metrics(srv.url)
        assert metric(m, "specdecode_generations_total", finish_reason="timeout") >= 2
    finally:
        ctl.gate.set()
        srv.stop()


# -- metrics ---------------------------------------------------------------------------------------------------------
def test_metrics_move(live):
    live.wait_idle()
    before = metrics(live.url)
    r = http.post(
        f"{live.url}/v1/completions",
        json={"model": MODEL, "prompt": "count me", "max_tokens": 10, "speculation": {"method": "draft", "gamma": 3}},
    )
    assert r.status_code == 200
    spec = r.json()["speculation"]
    http.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": ""})
    live.wait_idle()
    after = metrics(live.url)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("specdecode_requests_total", route="/v1/completions", status="200") == 1
    assert delta("specdecode_requests_total", route="/v1/completions", status="400") == 1
    assert delta("specdecode_prompt_tokens_total") == len("count me")
    assert delta("specdecode_generated_tokens_total") == r.json()["usage"]["completion_tokens"] == 10
    assert delta("specdecode_drafted_tokens_total", method="draft") == spec["drafted"] > 0
    assert delta("specdecode_accepted_tokens_total", method="draft") == spec["accepted"]
    assert delta("specdecode_drafted_by_position_total", position="0") == spec["drafted_per_position"][0]
    assert delta("specdecode_accepted_by_position_total", position="0") == spec["accepted_per_position"][0]
    assert delta("specdecode_time_to_first_token_seconds_count") == 1
    assert delta("specdecode_request_latency_seconds_count", endpoint="completions") == 1
    assert metric(after, "specdecode_server_info", model=MODEL, method="draft", gamma="3") == 1
    text = http.get(f"{live.url}/metrics").text
    for name in (
        "specdecode_requests_total",
        "specdecode_prompt_tokens_total",
        "specdecode_generated_tokens_total",
        "specdecode_drafted_tokens_total",
        "specdecode_accepted_tokens_total",
        "specdecode_accepted_by_position_total",
        "specdecode_time_to_first_token_seconds_bucket",
        "specdecode_request_latency_seconds_bucket",
        "specdecode_queue_depth",
        "specdecode_worker_busy",
    ):
        assert name in text


# -- the CLI ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, match",
    [
        (["serve", "--max-queue", "0"], "max-queue"),
        (["serve", "--timeout", "0"], "timeout"),
        (["serve", "--gamma", "0"], "gamma"),
        (["serve", "--port", "70000"], "port"),
        (["serve", "--max-tokens", "0"], "max-tokens"),
        (["serve", "--ctx-size", "1"], "ctx-size"),
        (["serve", "--parallel", "2", "--prefill-chunk", "0"], "prefill-chunk must be at least 1"),
        (["serve", "--parallel", "2", "--prefill-chunk", "513"], "prefill-chunk must be at most 512"),
        (["serve", "--target", "somewhere", "--method", "draft"], "draft model"),
    ],
)
def test_serve_usage_errors(args, match, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdecode: error:") and match in err and err.count("\n") == 1


@pytest.mark.process
def test_serve_command_matches_generate(tiny_dirs, capsys):
    """`specdecode serve` in a subprocess: greedy HTTP output equals `specdecode generate --json`."""
    target, draft = tiny_dirs
    assert (
        main(
            [
                "generate",
                "hello",
                "--target",
                str(target),
                "--draft",
                str(draft),
                "--method",
                "draft",
                "--gamma",
                "3",
                "--max-new-tokens",
                "16",
                "--json",
            ]
        )
        == 0
    )
    cli_text = json.loads(capsys.readouterr().out)["text"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPECDECODE_API_KEY": KEY}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specdecode",
            "serve",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--gamma",
            "3",
            "--port",
            str(port),
            "--served-model-name",
            MODEL,
            "--max-tokens",
            "16",
            "--ctx-size",
            "100",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if http.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        out = client.completions.create(model=MODEL, prompt="hello", max_tokens=16, temperature=0)
        assert out.choices[0].text == cli_text
        head = {"Authorization": f"Bearer {KEY}"}
        r = http.post(
            f"{url}/v1/completions", headers=head, json={"model": MODEL, "prompt": "hello", "max_tokens": 17}
        )  # over --max-tokens
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = http.post(
            f"{url}/v1/completions", headers=head, json={"model": MODEL, "prompt": "x" * 90, "max_tokens": 16}
        )  # 90 + 16 > --ctx-size 100
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = http.post(f"{url}/v1/completions", headers=head, json={"model": MODEL, "prompt": "x" * 90})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 10  # the Engine stops at 100
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stderr.read()


# -- schemathesis over the app's own OpenAPI document ----------------------------------------------------------------
# Built at import: schemathesis.pytest.from_fixture does not work with this pytest (it reads a private attribute).
FUZZ_APP = create_app(build_engine(), model_id=MODEL, method="pld", gamma=2, max_tokens_cap=8)
schema = schemathesis.openapi.from_asgi("/openapi.json", FUZZ_APP)


@pytest.fixture(scope="module", autouse=True)
def _stop_fuzz_worker():
    yield
    FUZZ_APP.state.worker.stop()


def test_openapi_document_is_precise():
    doc = schema.raw_schema
    comp = doc["components"]["schemas"]
    req = comp["CompletionRequest"]["properties"]
    assert req["max_tokens"]["anyOf"][0]["maximum"] == 8 and req["max_tokens"]["anyOf"][0]["minimum"] == 1
    assert req["n"]["anyOf"][0]["maximum"] == 1
    methods = set(comp["Speculation"]["properties"]["method"]["anyOf"][0]["enum"])
    assert methods == set(METHODS) >= {"auto", "autoregressive", "draft", "pld", "tree"}
    assert "422" not in json.dumps(doc["paths"]) and "HTTPValidationError" not in comp
    assert set(doc["paths"]["/v1/chat/completions"]["post"]["responses"]) == {
        "200",
        "400",
        "401",
        "404",
        "413",
        "415",
        "503",
    }


@schema.parametrize()
@hypothesis.settings(
    max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(hypothesis.HealthCheck)
)
def test_schemathesis(case):
    """No 5xx, responses (JSON and each server-sent event) match the document, invalid data is rejected.
    Not checked: that every schema-valid request succeeds (an all-blank chat, or a prompt the context cannot
    hold, is schema-valid and still a 400)."""
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL  # otherwise nearly every generated request is a 404 (unknown model)
    response = case.call_and_validate(excluded_checks=[positive_data_acceptance])
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}


# -- hardening --------------------------------------------------------------------------------------------------------
class OneThreadTokenizer:
    """A tokenizer that records when two threads use it at once (fast tokenizers can fail then with
    "Already borrowed"); each call lingers a little so that an overlap cannot slip by."""

    def __init__(self, tok):
        self._tok, self._busy, self.overlaps, self.calls = tok, threading.Lock(), 0, 0

    def __getattr__(self, name):
        value = getattr(self._tok, name)
        if name not in ("__call__", "decode", "apply_chat_template", "get_added_vocab", "encode"):
            return value
        return self._guarded(value)

    def __call__(self, *args, **kw):
        return self._guarded(self._tok)(*args, **kw)

    def _guarded(self, fn):
        def call(*args, **kw):
            if not self._busy.acquire(blocking=False):
                self.overlaps += 1
                self._busy.acquire()
            try:
                self.calls += 1
                time.sleep(0.002)
                return fn(*args, **kw)
            finally:
                self._busy.release()

        return call


def test_the_tokenizer_is_never_used_by_two_threads_at_once():
    """Request handlers tokenize (in a thread pool) while the worker thread decodes: one lock serializes them."""
    tok = OneThreadTokenizer(byte_tokenizer())
    engine = build_engine(tokenizer=tok)
    srv = LiveServer(create_app(engine, model_id=MODEL, method="pld", gamma=2, max_queue=16))
    try:

        def ask(i):
            body = {"model": MODEL, "max_tokens": 12, "stream": i % 2 == 0}
            body.update({"messages": [{"role": "user", "content": f"chat {i}"}]} if i % 3 else {"prompt": f"text {i}"})
            path = "chat/completions" if i % 3 else "completions"
            return http.post(f"{srv.url}/v1/{path}", json=body, timeout=120).status_code

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(ask, range(16))) == [200] * 16
        assert tok.calls > 100 and tok.overlaps == 0, (tok.calls, tok.overlaps)
    finally:
        srv.stop()


def test_a_non_streamed_client_that_goes_away_frees_the_worker_while_text_flows():
    """Deltas keep coming every 10 ms, yet the server notices within a poll that the client is gone."""
    ctl = ControlledEngine(build_engine(), delay=0.01)
    srv = LiveServer(create_app(ctl, model_id=MODEL, method="autoregressive", gamma=1))
    try:
        body = {"model": MODEL, "prompt": "go on and on", "max_tokens": 450}
        with httpx.Client(timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
            c.post(f"{srv.url}/v1/completions", json=body)
        t0 = time.monotonic()
        srv.wait_idle(30)
        assert time.monotonic() - t0 < 2.0  # 450 tokens at >= 10 ms each would take 4.5 s more
        m = metrics(srv.url)
        assert metric(m, "specdecode_generations_total", finish_reason="cancelled") == 1
        assert metric(m, "specdecode_generated_tokens_total") < 450
    finally:
        srv.stop()


def test_cost_measurement_happens_at_start_up_never_in_a_request(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))  # an empty cache of its own: measured here
    engine = build_engine()
    srv = LiveServer(create_app(engine, model_id=MODEL, method="draft", gamma=3))  # a method without costs
    try:
        assert engine.costs is not None  # measured before the first request, for any method a request may ask for
        assert list((tmp_path / "cache" / "costs").glob("*.json"))  # by this start-up
    finally:
        srv.stop()


def test_shutdown_while_a_pass_runs_ends_the_stream_with_an_error_event():
    ctl = ControlledEngine(build_engine(), delay=0.02)
    srv = LiveServer(create_app(ctl, model_id=MODEL, method="autoregressive", gamma=1))
    body = {"model": MODEL, "prompt": "go on and on", "max_tokens": 400, "stream": True}
    with http.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        t0 = time.monotonic()
        stopper = threading.Thread(target=srv.stop, daemon=True)
        stopper.start()
        rest = [line for line in lines if line]
    stopper.join(30)
    assert not stopper.is_alive() and time.monotonic() - t0 < 3  # 400 tokens at >= 20 ms would take 8 s
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["error"]["code"] == "shutting_down"


@pytest.mark.parametrize("stream", [True, False])
def test_a_job_taken_but_not_started_at_shutdown_still_ends_with_an_error(monkeypatch, stream):
    """The worker took the job out of the queue, then the server began shutting down before the job ran: its
    client gets the shutting-down error, not a stream left open."""
    from specdecode.server.scheduler import Worker

    taken, proceed = threading.Event(), threading.Event()
    run = Worker._run

    def held_run(self, job, *args, **kwargs):
        taken.set()
        assert proceed.wait(30)
        return run(self, job, *args, **kwargs)

    monkeypatch.setattr(Worker, "_run", held_run)
    srv = LiveServer(create_app(build_engine(), model_id=MODEL, method="autoregressive", gamma=1))
    try:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "stream": stream}
        results = {}
        t = _post_in_thread(f"{srv.url}/v1/completions", body, results, "a")
        assert taken.wait(30)
        srv.worker.close()  # what the server's shutdown does first
        proceed.set()
        t.join(15)
        assert not t.is_alive(), "the client got no end"
        r = results["a"]
        if stream:
            events = [line for line in r.text.splitlines() if line]
            assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "shutting_down"
        else:
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    finally:
        proceed.set()
        srv.stop()


def test_serve_gives_uvicorn_a_graceful_shutdown_timeout(tiny_dirs, monkeypatch):
    """uvicorn waits for open connections at shutdown without end unless told a timeout."""
    from specdecode.server import app as app_module

    configs = []

    class Recorder:
        def __init__(self, config):
            configs.append(config)

        def run(self):
            pass

    monkeypatch.setattr(app_module, "Server", Recorder)
    target, draft = tiny_dirs
    assert main(["serve", "--target", str(target), "--draft", str(draft), "--method", "pld", "--port", "0"]) == 0
    assert configs and 0 < configs[0].timeout_graceful_shutdown <= 30


class _FailingStream(_ControlledStream):
    """Two deltas, then `how`: "raise" (the generation fails) or "unserializable" (its stats cannot be sent)."""

    def __init__(self, inner, ctl, how):
        super().__init__(inner, ctl)
        self.how = how

    @property
    def stats(self):
        stats = self.inner.stats
        if self.how != "unserializable":
            return stats

        class Bad:
            def __getattr__(self, name):
                return getattr(stats, name)

            def as_dict(self):
                return {**stats.as_dict(), "bad": object()}

        return Bad()

    def __iter__(self):
        for i, delta in enumerate(self.inner):
            if i == 2 and self.how == "raise":
                raise RuntimeError("boom")
            yield delta


@pytest.mark.parametrize("how", ["raise", "unserializable"])
def test_an_error_after_the_stream_began_ends_it_with_an_error_event(how):
    ctl = ControlledEngine(build_engine())
    ctl.open = lambda request: _FailingStream(ctl._engine.open(request), ctl, how)
    srv = LiveServer(create_app(ctl, model_id=MODEL, method="autoregressive", gamma=1))
    try:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 8, "stream": True}
        with http.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line]
        assert events[-1] == "data: [DONE]", events
        assert json.loads(events[-2][6:])["error"]["code"] == "internal_error"
        assert http.post(f"{srv.url}/v1/completions", json={**body, "stream": False}).status_code == 500
        assert http.get(f"{srv.url}/health").json()["busy"] is False  # and the server goes on
    finally:
        srv.stop()


class _RaisingStream(_ControlledStream):
    """`after` deltas, then the Engine error `error` (as a backend raises it mid-generation)."""

    def __init__(self, inner, ctl, error, after):
        super().__init__(inner, ctl)
        self.error, self.after = error, after

    def __iter__(self):
        for i, delta in enumerate(self.inner):
            if i == self.after:
                raise self.error
            yield delta


ENGINE_FAULTS = [  # (the backend's error, after how many deltas, status, code): its class decides, not its words
    (EngineUnavailable("llama_decode failed with status 1 (3 tokens of a batched pass)"), 2, 503, "engine_unavailable"),
    (EngineUnavailable("the prompt has 5000 tokens"), 1, 503, "engine_unavailable"),
    (
        SpecDecodeError("llama_decode failed: a tree pass of 600 tokens exceeds llama.cpp's batch"),
        2,
        500,
        "engine_error",
    ),
    (
        ContextExceeded("llama.cpp context overflow: 4000 + 200 tokens", param="prompt"),
        0,
        400,
        "context_length_exceeded",
    ),
]


@pytest.mark.parametrize("error, after, status, code", ENGINE_FAULTS, ids=[f[3] + str(f[1]) for f in ENGINE_FAULTS])
def test_an_engine_error_mid_generation_is_the_servers_fault_unless_the_clients(error, after, status, code):
    ctl = ControlledEngine(build_engine())
    ctl.open = lambda request: _RaisingStream(ctl._engine.open(request), ctl, error, after)
    srv = LiveServer(create_app(ctl, model_id=MODEL, method="autoregressive", gamma=1))
    try:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 8}
        r = http.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] == code and err["type"] == ("invalid_request_error" if status < 500 else "server_error")
        assert ("retry-after" in r.headers) == (status == 503)
        with http.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == code
        m = metrics(srv.url)
        assert metric(m, "specdecode_generation_errors_total", status=str(status), code=code) == 2
        assert metric(m, "specdecode_generations_total", finish_reason="error") == 2
    finally:
        srv.stop()


def test_a_request_body_over_the_limit_is_a_413_before_it_is_read():
    srv = LiveServer(create_app(build_engine(), model_id=MODEL, method="pld", gamma=2, max_body_bytes=2000))
    try:
        url = f"{srv.url}/v1/completions"
        big = {"model": MODEL, "prompt": "x" * 3000, "max_tokens": 2}
        r = http.post(url, json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert "2000 bytes" in r.json()["error"]["message"]
        chunks = (json.dumps(big)[i : i + 500].encode() for i in range(0, 3100, 500))  # chunked: no Content-Length
        r = http.post(url, content=chunks, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert http.post(url, json={**big, "prompt": "x" * 100}).status_code == 200
    finally:
        srv.stop()


def test_an_obviously_too_long_prompt_and_a_full_queue_are_refused_before_tokenizing(monkeypatch):
    ctl = ControlledEngine(build_engine())
    srv = LiveServer(create_app(ctl, model_id=MODEL, method="autoregressive", gamma=1, max_queue=1))
    calls = []
    encode = ctl._engine.encode
    monkeypatch.setattr(ctl._engine, "encode", lambda *a, **kw: calls.append(a) or encode(*a, **kw))
    try:
        url = f"{srv.url}/v1/completions"
        # no token of the byte tokenizer covers more than 13 characters: 512 tokens cover at most 13,312
        r = http.post(url, json={"model": MODEL, "prompt": "x" * 14000, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = http.post(
            f"{srv.url}/v1/chat/completions",
            json={
                "model": MODEL,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "x" * 7000}, {"role": "user", "content": "y" * 7000}],
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert calls == []
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 2}
        ctl.gate.clear()
        results = {}
        a = _post_in_thread(url, body, results, "a")  # generating, held at the gate
        wait_for(lambda: srv.worker.busy)
        b = _post_in_thread(url, body, results, "b")  # waiting
        wait_for(lambda: srv.worker.queued == 1)
        assert len(calls) == 2
        r = http.post(url, json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        assert len(calls) == 2  # refused before tokenizing
        ctl.gate.set()
        a.join(60), b.join(60)
        assert results["a"].status_code == results["b"].status_code == 200
    finally:
        ctl.gate.set()
        srv.stop()


def test_the_output_history_is_off_by_default_kept_per_api_key_and_never_holds_prompts():
    from specdecode.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.history_tokens == 0 and not args.speculation_sources  # off unless the operator enables it
    engine = build_engine(history_tokens=5000)
    srv = LiveServer(create_app(engine, model_id=MODEL, method="lookup", gamma=2))
    try:
        prompt = "the secret prompt"
        prompt_ids = engine.encode(prompt)

        def ask(key):
            r = http.post(
                f"{srv.url}/v1/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": MODEL, "prompt": prompt, "max_tokens": 12},
                timeout=60,
            )
            assert r.status_code == 200
            return r.json()

        out = ask("sk-alice")
        assert "sources" not in out["speculation"]  # per-source counts only where the operator asks for them
        ask("sk-bob")
        ask("sk-alice")
        histories = srv.app.state.service.histories
        assert len(histories) == 2 and len(engine.history.live) == 0  # one per key; the engine's shared one unused
        for h in histories.values():
            stored = h.index.tokens
            assert stored and not any(stored[i : i + 4] == prompt_ids[:4] for i in range(len(stored)))  # outputs only
        assert [len(h.live) for h in histories.values()] == [1, 2]  # bob's, then alice's two
    finally:
        srv.stop()


def test_per_source_counts_in_responses_when_the_operator_asks():
    srv = LiveServer(create_app(build_engine(), model_id=MODEL, method="pld", gamma=2, show_sources=True))
    try:
        r = http.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "abcabc", "max_tokens": 8})
        assert "sources" in r.json()["speculation"]
    finally:
        srv.stop()


def test_a_started_stream_that_is_silent_gets_keepalives():
    """A job that the worker runs but that sends nothing for a while (a long prompt being read) keeps its stream
    alive with comments, as a queued one does; then its text follows."""
    ctl = ControlledEngine(build_engine())
    srv = LiveServer(create_app(ctl, model_id=MODEL, method="autoregressive", gamma=1, keepalive_s=0.2))
    try:
        ctl.gate.clear()  # the job starts, then stays silent at the gate
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 6, "stream": True}
        with http.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=5) as r:
            lines = r.iter_lines()
            comments = 0
            for line in lines:
                if line == ": keep-alive":
                    assert srv.worker.busy and srv.worker.queued == 0
                    comments += 1
                    if comments == 3:
                        break
            ctl.gate.set()
            rest = [line for line in lines if line and line != ": keep-alive"]
        assert rest[-1] == "data: [DONE]" and len(rest) > 2
    finally:
        ctl.gate.set()
        srv.stop()


@pytest.mark.parametrize("own_tokenizer", [True, False])
def test_a_running_stream_is_not_stalled_by_big_requests_being_tokenized(own_tokenizer, monkeypatch):
    """Requests are tokenized on a tokenizer copy of their own (a few at a time), so the running stream's per-step
    decoding never waits for them: its gaps stay well under one big body's tokenization. Negative control: on the
    engine's one tokenizer (own_tokenizer False) a gap lasts about a whole tokenization."""
    if not own_tokenizer:
        monkeypatch.setattr(Engine, "separate_encoder", lambda self, copies=1: None)
    ctl = ControlledEngine(build_engine(), delay=0.02)
    srv = LiveServer(create_app(ctl, model_id=MODEL, method="autoregressive", gamma=1))
    srv.app.state.service.token_chars = None  # no character pre-check: the bodies are tokenized, then refused
    big = "hello world " * 100_000  # 1.2 MB
    t0 = time.perf_counter()
    ctl._engine.encoder(big)
    tokenize_s = time.perf_counter() - t0
    try:
        arrivals, results = [], {}
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 400, "stream": True}
        with http.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
            threads = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.perf_counter())
                if len(arrivals) == 5 and not threads:
                    threads = [
                        _post_in_thread(
                            f"{srv.url}/v1/completions", {"model": MODEL, "prompt": big, "max_tokens": 4}, results, k
                        )
                        for k in range(3)
                    ]
                if threads and not any(t.is_alive() for t in threads):
                    break
        for t in threads:
            t.join(120)
        assert all(results[k].status_code == 400 for k in range(3))  # tokenized, then refused: past the context
        gap = max(b - a for a, b in zip(arrivals[4:], arrivals[5:]))
        if own_tokenizer:
            assert gap < tokenize_s / 2, (gap, tokenize_s)
        else:
            assert gap > tokenize_s / 2, (gap, tokenize_s)
    finally:
        srv.stop()
