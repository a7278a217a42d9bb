"""The web page at GET /, in headless Chromium (the system's, driven by Playwright for Python) against live servers on
the tiny models: it streams the API's answer with each token coloured by the source the API reports, stops and frees
the slot, compares with plain decoding, and says what went wrong in words. `-m browser` runs these alone."""

import json
import os
import shutil
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import LiveServer, http
from specdecode.server import create_app
from tiny import char_tokenizer

MODEL = "tiny"
KEY = "sk-page-0123456789"
INSTALL = (
    "no headless Chromium: install the system's (Debian: `apt-get install chromium`, or set CHROMIUM to its "
    "binary) and Playwright for Python (`pip install playwright`; no `playwright install` needed)"
)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PREDICTION_BG = "rgb(187, 247, 208)"  # page.css: --src-prediction
DRAFT_BG = "rgb(191, 219, 254)"  # --src-draft

pytestmark = [
    pytest.mark.browser,
    pytest.mark.process,
    pytest.mark.xdist_group("browser"),
    pytest.mark.usefixtures("one_torch_thread"),
]


def chromium() -> str | None:
    """The browser binary: $CHROMIUM, else the first Chromium on PATH (never one downloaded at run time)."""
    for candidate in (
        os.environ.get("CHROMIUM"),
        *map(shutil.which, ("chromium", "chromium-browser", "google-chrome")),
    ):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


SHARED_CACHE = True  # one cache for this module's servers (conftest)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A persistent Chromium context in a fresh profile; each test opens its own tab (its own session storage)."""
    binary = chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(INSTALL)
    if binary is None:
        pytest.skip(INSTALL)
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=binary,
            args=FLAGS,
            headless=True,
            viewport={"width": 1200, "height": 800},
        )
        yield context
        context.close()


def serve(make_engine, cache, draft=0, **app) -> LiveServer:
    """A server on the tiny models with a character tokenizer (every answer encodes back to its own tokens, so it
    can come back as a prediction); draft 0 is the target itself: its greedy guesses are all kept."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_CACHE", str(cache))
        engine = make_engine(0, draft, char_tokenizer())
        return LiveServer(create_app(engine, model_id=MODEL, method=app.pop("method", "draft"), gamma=3, **app))


@pytest.fixture(scope="module")
def live(make_engine, _module_cache):
    srv = serve(make_engine, _module_cache, show_sources=True)
    yield srv
    srv.stop()


class Tab:
    """One tab on the page, with what it logged and asked for."""

    def __init__(self, context, url):
        self.page = context.new_page()
        self.errors, self.requests = [], []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(url)
        self.idle()

    def idle(self, timeout=60_000):
        self.page.wait_for_function("document.body.dataset.state === 'idle'", timeout=timeout)

    def settings(self, method=None, temperature=None, max_tokens=None, exact=None, compare=None):
        p = self.page
        if method is not None:
            p.select_option("#method", method)
        if temperature is not None:
            p.fill("#temperature", str(temperature))
        if max_tokens is not None:
            p.fill("#max-tokens", str(max_tokens))
        for box, on in (("#exact", exact), ("#compare", compare)):
            if on is not None:
                p.set_checked(box, on)

    def send(self, text, prediction=None, wait=True):
        if prediction is not None:
            self.page.click("#prediction-box summary")
            self.page.fill("#prediction", prediction)
        self.page.fill("#message", text)
        self.page.press("#message", "Enter")
        if wait:
            self.idle()

    def tokens(self, where="#conversation .message.assistant:last-of-type") -> list[dict]:
        """The last answer's token spans: token, source, text (a token split by a code fence: its spans joined)."""
        spans = self.page.eval_on_selector_all(
            f"{where} .tok",
            "els => els.map(e => ({token: e.dataset.token, source: e.dataset.source, "
            "text: e.textContent, bg: getComputedStyle(e).backgroundColor}))",
        )
        out: dict[int, dict] = {}
        for s in spans:
            t = out.setdefault(int(s["token"]), {**s, "text": ""})
            t["text"] += s["text"]
        return [out[k] for k in sorted(out)]

    def text(self, selector) -> str:
        return self.page.inner_text(selector) if self.page.is_visible(selector) else ""

    def close(self):
        self.page.close()


@pytest.fixture
def tab(browser, live):
    t = Tab(browser, live.url + "/")
    yield t
    t.close()


def api_stream(url, body, headers=None) -> dict:
    """The API's streamed answer to `body` with per-token sources: text, one entry per token, usage."""
    r = http.post(
        f"{url}/v1/chat/completions",
        headers=headers or {},
        timeout=120,
        json={"model": MODEL, "stream": True, "stream_options": {"include_sources": True}, **body},
    )
    assert r.status_code == 200, r.text
    text, tokens, usage = "", {}, None
    for event in r.text.split("\n\n"):
        if event.startswith("data: {"):
            chunk = json.loads(event[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text += choice["delta"].get("content", "")
                for e in choice.get("sources") or []:
                    tokens.setdefault(e["token"], {**e, "text": ""})["text"] += e["text"]
    return {"text": text, "tokens": [tokens[k] for k in sorted(tokens)], "usage": usage}


def request(message, method, max_tokens, **extra) -> dict:
    return {
        "messages": [{"role": "user", "content": message}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "speculation": {"method": method},
        **extra,
    }


def metric(url, name, **labels) -> float:
    for family in text_string_to_metric_families(http.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def screenshot(tab, name, tmp_path) -> Path:
    """A PNG of the page: into $SPECDECODE_SCREENSHOTS (the docs' pictures are made so) or the test's folder."""
    folder = Path(os.environ.get("SPECDECODE_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    tab.page.screenshot(path=str(path), type="png")
    return path


# -- tests ------------------------------------------------------------------------------------------------------------
def test_the_page_loads_and_answers_with_no_console_error_and_nothing_from_another_host(tab, live):
    assert tab.page.title() == "specdecode" and tab.page.inner_text("#model") == MODEL
    tab.settings(method="draft", max_tokens=24)
    tab.send("hello")
    assert len(tab.tokens()) == 24
    assert tab.errors == []
    host = urlsplit(live.url).netloc
    assert tab.requests and all(urlsplit(u).netloc == host for u in tab.requests), tab.requests
    assert any(u.endswith("/static/favicon.svg") for u in tab.requests)


def test_the_answer_is_the_apis_and_each_tokens_colour_its_source(tab, live):
    message = "the cat sat on the mat; the cat sat on the mat"
    tab.settings(method="draft", max_tokens=40)
    tab.send(message)
    api = api_stream(live.url, request(message, "draft", 40))
    got = tab.tokens()
    assert "".join(t["text"] for t in got) == api["text"]
    assert [(t["text"], t["source"]) for t in got] == [(t["text"], t["source"]) for t in api["tokens"]]
    assert len(got) == api["usage"]["completion_tokens"]
    sources = {t["source"] for t in got}
    assert {"draft", "target"} <= sources  # the draft is the target: its guesses are kept, a bonus token per pass
    for t in got:
        assert t["bg"] == (DRAFT_BG if t["source"] == "draft" else "rgba(0, 0, 0, 0)")
    assert int(tab.page.get_attribute("#chart", "data-steps")) == len({t["step"] for t in api["tokens"]})
    assert "draft" in tab.page.inner_text("#n-sources")
    tab.page.set_checked("#colours", False)  # the toggle: no colour at all
    assert {t["bg"] for t in tab.tokens()} == {"rgba(0, 0, 0, 0)"}
    title = tab.page.get_attribute("#conversation .message.assistant:last-of-type .tok[data-source=draft]", "title")
    assert "step" in title and "accepted" in title


def test_a_prediction_turns_its_tokens_green(tab, live, tmp_path):
    message = "Rewrite: the quick brown fox jumps over the lazy dog"
    answer = api_stream(live.url, request(message, "autoregressive", 60))["text"]
    tab.settings(method="lookup", max_tokens=60, compare=True)  # plain decoding beside it, for the picture
    tab.send(message, prediction=answer)
    got = tab.tokens()
    assert "".join(t["text"] for t in got) == answer
    predicted = [t for t in got if t["source"] == "prediction"]
    assert len(predicted) > len(got) // 2 and all(t["bg"] == PREDICTION_BG for t in predicted)
    accepted, rejected = map(int, tab.page.inner_text("#n-prediction").split(" / "))
    assert accepted >= len(predicted) > 0  # usage counts the prediction's tokens the answer holds
    api = api_stream(live.url, request(message, "lookup", 60, prediction={"type": "content", "content": answer}))
    assert [t["source"] for t in got] == [t["source"] for t in api["tokens"]]
    shot = screenshot(tab, "webpage.png", tmp_path)
    assert shot.stat().st_size < 200_000


def test_stop_ends_the_stream_and_frees_the_slot(browser, make_engine, _module_cache):
    srv = serve(make_engine, _module_cache)
    real = srv.app.state.engine.target.forward

    def slow(*args, **kwargs):  # a pass the page can be stopped in the middle of
        time.sleep(0.05)
        return real(*args, **kwargs)

    srv.app.state.engine.target.forward = slow
    tab = Tab(browser, srv.url + "/")
    try:
        tab.settings(method="autoregressive", max_tokens=400)
        tab.send("go on and on", wait=False)
        tab.page.wait_for_function("document.querySelectorAll('#conversation .tok').length >= 3")
        assert metric(srv.url, "specdecode_worker_busy") == 1
        tab.page.click("#stop")
        tab.idle()
        assert tab.page.inner_text("#spec-numbers") == "stopped"
        deadline = time.monotonic() + 10
        while metric(srv.url, "specdecode_generations_total", finish_reason="cancelled") < 1:
            assert time.monotonic() < deadline, "the generation was not cancelled"
            time.sleep(0.1)
        assert metric(srv.url, "specdecode_worker_busy") == 0
        assert len(tab.tokens()) < 400
        srv.app.state.engine.target.forward = real
        tab.settings(max_tokens=8)
        tab.send("again")  # the page and the slot serve the next message
        assert len(tab.tokens()) == 8 and tab.text("#error") == ""
    finally:
        tab.close()
        srv.stop()


def test_a_wrong_key_is_said_in_words_and_the_right_one_works(browser, make_engine, _module_cache):
    srv = serve(make_engine, _module_cache, api_key=KEY)
    tab = Tab(browser, srv.url + "/")
    try:
        assert tab.page.is_visible("#key-dialog")  # the server asked for a key: the page asks for it once
        tab.page.fill("#key", "wrong")
        tab.page.click("#key-save")
        tab.page.wait_for_function("document.querySelector('#key-error').textContent.length > 0")
        assert "refused this API key" in tab.page.inner_text("#key-error")
        assert "refused this API key" in tab.page.inner_text("#error")
        tab.page.fill("#key", KEY)
        tab.page.click("#key-save")
        tab.page.wait_for_function(f"document.querySelector('#model').textContent === '{MODEL}'")
        assert not tab.page.is_visible("#error") and not tab.page.is_visible("#key-dialog")
        tab.settings(max_tokens=6)
        tab.send("hi")
        assert len(tab.tokens()) == 6
        assert tab.page.evaluate("Object.keys(localStorage).length") == 0  # the key lives in this tab only
        assert tab.page.evaluate("sessionStorage.getItem('specdecode-api-key')") == KEY
    finally:
        tab.close()
        srv.stop()


def test_compare_mode_shows_identical_greedy_answers_in_exact_mode(tab, live):
    tab.settings(method="draft", max_tokens=32, exact=True, compare=True)
    tab.send("abcabcabc")
    tab.page.wait_for_selector("#compare-verdict:not([hidden])")
    assert tab.page.get_attribute("#compare-verdict", "data-identical") == "true"
    assert "identical" in tab.page.inner_text("#compare-verdict")
    plain = tab.tokens("#plain-answer")
    assert "".join(t["text"] for t in plain) == "".join(t["text"] for t in tab.tokens())
    assert {t["source"] for t in plain} == {"target"}
    api = api_stream(live.url, request("abcabcabc", "autoregressive", 32))
    assert api["text"] == "".join(t["text"] for t in plain)
    assert "s" in tab.page.inner_text("#plain-numbers")


def test_a_4xx_is_shown_and_the_page_keeps_working(tab):
    tab.settings(max_tokens=100_000)
    tab.send("hi")
    error = tab.text("#error")
    assert "refused the request (400" in error and "max_tokens" in error
    tab.settings(max_tokens=8)
    tab.send("a" * 600)  # more than the context holds
    assert "context_length_exceeded" in tab.text("#error")
    assert tab.page.input_value("#message") == "a" * 600  # a refused message goes back to the box
    tab.send("fine")
    assert len(tab.tokens()) == 8 and tab.text("#error") == ""


@pytest.mark.parametrize("how", ["500", "dropped"])
def test_a_server_failure_or_a_dropped_stream_is_said_in_words(tab, how):
    def answer(route):
        if how == "500":
            route.fulfill(
                status=500,
                content_type="application/json",
                body=json.dumps(
                    {"error": {"message": "internal server error", "type": "server_error", "code": "internal_error"}}
                ),
            )
        else:  # a stream that stops before [DONE]
            chunk = {
                "id": "x",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": "par"},
                        "sources": [
                            {"token": 0, "text": "par", "source": "target", "step": 1, "drafted": 0, "accepted": 0}
                        ],
                    }
                ],
            }
            route.fulfill(status=200, content_type="text/event-stream", body=f"data: {json.dumps(chunk)}\n\n")

    tab.page.route("**/v1/chat/completions", answer)
    tab.send("hi")
    error = tab.text("#error")
    if how == "500":
        assert "The server failed (500, internal_error): internal server error" in error
    else:
        assert "connection dropped" in error and "".join(t["text"] for t in tab.tokens()) == "par"
    tab.page.unroute("**/v1/chat/completions")
    tab.settings(max_tokens=4)
    tab.send("again")
    assert len(tab.tokens()) == 4 and tab.text("#error") == ""


def test_on_a_phone_nothing_overflows(tab, tmp_path):
    tab.page.set_viewport_size({"width": 390, "height": 844})
    tab.settings(method="draft", max_tokens=48, compare=True)
    tab.send("Fix this:\n```python\n" + "x = " + "1 + " * 30 + "1\n```\n" + "w" * 150)  # long unbroken lines
    assert tab.text("#error") == "" and tab.page.is_visible("#compare-verdict")
    wide = tab.page.evaluate("""() => {
        const out = [];
        for (const el of document.querySelectorAll('body *')) {
            const r = el.getBoundingClientRect();
            if (r.width && r.right > window.innerWidth + 0.5 && !el.closest('pre')) out.push(el.tagName + '#' + el.id);
        }
        return out;
    }""")
    assert wide == []
    assert tab.page.evaluate("document.documentElement.scrollWidth") <= 390
    shot = screenshot(tab, "webpage-phone.png", tmp_path)
    assert shot.stat().st_size < 200_000


def test_code_blocks_are_rendered_as_code_with_a_copy_button(tab, live):
    tab.page.evaluate("""() => import('./static/answer.js').then(({Answer}) => {
        const el = document.createElement('div');
        el.id = 'made';
        document.body.append(el);
        const a = new Answer(el);
        const pieces = ['Here:\\n', '``', '`py', '\\nx = 1\\n', '```', '\\ndone'];
        a.add(pieces.map((text, token) => ({token, text, source: token % 2 ? 'draft' : 'target', step: token + 1,
                                            drafted: 1, accepted: token % 2})));
        a.render();
    })""")
    assert tab.page.inner_text("#made figure.code pre") == "x = 1\n"
    assert tab.page.inner_text("#made figure.code figcaption span") == "py"
    assert tab.page.is_visible("#made figure.code button.copy")
    assert tab.page.evaluate("[...document.querySelectorAll('#made .tok')].map(e => e.textContent).join('')") == (
        "Here:\n```py\nx = 1\n```\ndone"
    )
    tokens = tab.page.evaluate("[...new Set([...document.querySelectorAll('#made .tok')].map(e => e.dataset.token))]")
    assert tokens == [str(i) for i in range(6)]  # every token has its element, a fence's hidden ones too


def test_the_page_works_under_a_path_prefix(browser, live, make_engine, _module_cache):
    from starlette.applications import Starlette
    from starlette.routing import Mount

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_CACHE", str(_module_cache))
        app = create_app(make_engine(0, 0, char_tokenizer()), model_id=MODEL, method="draft", gamma=3)
        srv = LiveServer(Starlette(routes=[Mount("/prefix", app=app)]))
    tab = Tab(browser, srv.url + "/prefix")  # without the trailing slash
    try:
        tab.settings(max_tokens=5)
        tab.send("hi")
        assert len(tab.tokens()) == 5 and tab.errors == []
        assert urlsplit(tab.requests[0]).path == "/prefix"  # redirected to /prefix/; all else below it
        assert all(urlsplit(u).path.startswith("/prefix/") for u in tab.requests[1:]), tab.requests
    finally:
        tab.close()
        srv.stop()
    page = http.get(f"{live.url}/").text
    assert '<base href="/">' in page
