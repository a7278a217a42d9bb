"""Who reaches what: /v1 takes only bodies declared JSON (a browser's cross-site form post never starts a
generation), and with protect_all (`serve --protect-all`) the API key guards /metrics and the API docs as it
guards /v1, while /health and the web page stay open."""

import pytest

from helpers import LiveServer, http
from specdecode.cli import main
from specdecode.errors import SpecDecodeError
from specdecode.server import create_app

MODEL = "tiny"
KEY = "sk-test-0123456789"
BODY = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)


SHARED_CACHE = True  # one cache for this module's servers (conftest)


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
def test_a_body_not_declared_json_is_a_415_and_starts_no_generation(tiny_engine, monkeypatch, content_type):
    opened = []
    open_ = tiny_engine.open
    monkeypatch.setattr(tiny_engine, "open", lambda request: opened.append(1) or open_(request))
    srv = LiveServer(create_app(tiny_engine, model_id=MODEL, method="pld", gamma=2))
    try:
        headers = {} if content_type is None else {"content-type": content_type}
        for path in ("completions", "chat/completions"):
            r = http.post(f"{srv.url}/v1/{path}", content=BODY, headers=headers, timeout=60)
            assert r.status_code == 415, r.text
            assert r.json()["error"]["code"] == "unsupported_media_type"
        assert opened == []
        ok = http.post(
            f"{srv.url}/v1/completions",
            content=BODY,
            timeout=60,
            headers={"content-type": "application/json; charset=utf-8"},
        )
        assert ok.status_code == 200 and opened == [1]
        assert http.get(f"{srv.url}/v1/models").status_code == 200  # no body, no Content-Type needed
    finally:
        srv.stop()


def test_with_a_key_the_key_is_asked_before_the_content_type(tiny_engine):
    srv = LiveServer(create_app(tiny_engine, model_id=MODEL, method="pld", gamma=2, api_key=KEY))
    try:
        r = http.post(f"{srv.url}/v1/completions", content=BODY, headers={"content-type": "text/plain"})
        assert r.status_code == 401
        r = http.post(
            f"{srv.url}/v1/completions",
            content=BODY,
            headers={"content-type": "text/plain", "Authorization": f"Bearer {KEY}"},
        )
        assert r.status_code == 415
    finally:
        srv.stop()


GUARDED = ("/metrics", "/openapi.json", "/docs", "/redoc")


@pytest.mark.parametrize("protect_all", [False, True])
@pytest.mark.parametrize("mounted", [False, True])
def test_protect_all_puts_metrics_and_the_docs_behind_the_key(tiny_engine, protect_all, mounted):
    app = create_app(tiny_engine, model_id=MODEL, method="pld", gamma=2, api_key=KEY, protect_all=protect_all)
    if mounted:  # under a path prefix the Gate matches the path the app's routing sees
        from starlette.applications import Starlette
        from starlette.routing import Mount

        app = Starlette(routes=[Mount("/prefix", app=app)])
    srv = LiveServer(app)
    base = f"{srv.url}/prefix" if mounted else srv.url
    try:
        for path in GUARDED:
            r = http.get(base + path, timeout=60)
            assert r.status_code == (401 if protect_all else 200), (path, r.text)
            if protect_all:
                assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
                wrong = http.get(base + path, headers={"Authorization": "Bearer wrong"}, timeout=60)
                assert wrong.status_code == 401
            r = http.get(base + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
            assert r.status_code == 200, (path, r.text)
        assert http.get(f"{base}/health", timeout=60).status_code == 200
        assert http.get(f"{base}/", timeout=60).status_code == 200  # the page holds no data: it asks for the key
        assert http.get(f"{base}/v1/models", timeout=60).status_code == 401
    finally:
        srv.stop()


def test_protect_all_needs_a_key(tiny_engine, monkeypatch, capsys):
    with pytest.raises(SpecDecodeError, match="needs an API key"):
        create_app(tiny_engine, model_id=MODEL, protect_all=True)
    monkeypatch.delenv("SPECDECODE_API_KEY", raising=False)
    assert main(["serve", "--protect-all"]) == 2  # before any model loads
    assert "--protect-all needs an API key" in capsys.readouterr().err
