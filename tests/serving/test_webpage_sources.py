"""Per-token sources in streams (stream_options.include_sources): each chunk's entries add up to its text, every token
of the answer has its entries, in order, and their sources add up to the generation's own counts; for every method,
greedy and sampled, one generation at a time and with batch slots; clients that do not ask see nothing new."""

import json
import re
from collections import Counter

import openai
import pytest

from helpers import LiveServer, http
from specdecode import Engine
from specdecode.server import create_app

MODEL = "tiny"
METHODS = ["autoregressive", "draft", "pld", "lookup", "tree", "auto"]
PROMPT = "the cat sat on the mat; the cat sat on the mat; the cat"

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)


SHARED_CACHE = True  # one cache for this module's servers (conftest)


@pytest.fixture(scope="module")
def alone(make_engine, _module_cache):
    """One generation at a time, on torch: the draft model is the target itself (its guesses are kept, greedy), so
    answers mix draft, copied and target tokens."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_CACHE", str(_module_cache))
        srv = LiveServer(create_app(make_engine(0, 0), model_id=MODEL, method="draft", gamma=3, show_sources=True))
        yield srv
        srv.stop()


@pytest.fixture(scope="module")
def batched(tmp_path_factory, _module_cache):
    """Two batch slots on llama.cpp (--parallel 2), the same GGUF as target and draft."""
    pytest.importorskip("llama_cpp")
    from specdecode.backends.llamacpp import LlamaLM
    from specdecode.slots import Slots
    from tiny import byte_tokenizer
    from tinygguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path_factory.mktemp("sources") / "tiny.gguf", 0, hidden=128)
    tok = byte_tokenizer()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_CACHE", str(_module_cache))
        engine = Engine(LlamaLM(gguf, threads=1), tok, LlamaLM(gguf, threads=1), tok)
        engine.progress = False
        srv = LiveServer(
            create_app(engine, model_id=MODEL, method="draft", gamma=3, show_sources=True, slots=Slots(engine, 2))
        )
        yield srv
        srv.stop()


def stream(url: str, body: dict, endpoint: str = "chat/completions") -> dict:
    """The streamed answer: its chunks as (text, entries or None), usage, speculation and whole text."""
    r = http.post(f"{url}/v1/{endpoint}", json={"model": MODEL, "stream": True, **body}, timeout=120)
    assert r.status_code == 200, r.text
    out = {"chunks": [], "usage": None, "speculation": None, "text": "", "fields": set()}
    for event in r.text.split("\n\n"):
        if not event.startswith("data: {"):
            continue
        chunk = json.loads(event[6:])
        assert "error" not in chunk, chunk
        out["usage"] = chunk.get("usage") or out["usage"]
        out["speculation"] = chunk.get("speculation") or out["speculation"]
        for choice in chunk["choices"]:
            out["fields"] |= set(choice)
            text = choice["text"] if "text" in choice else choice["delta"].get("content", "")
            out["chunks"].append((text, choice.get("sources")))
            out["text"] += text
    return out


def check(out: dict) -> list[dict]:
    """The entries of a streamed answer, checked against its text and its stats; returns one entry per token."""
    tokens: list[dict] = []
    for text, entries in out["chunks"]:
        assert entries is not None or text == "", "a chunk with text but no sources"
        assert "".join(e["text"] for e in entries or []) == text  # the entries cut the chunk's text exactly
        for e in entries or []:
            if tokens and tokens[-1]["token"] == e["token"]:  # a token two chunks share
                assert {k: v for k, v in e.items() if k != "text"} == {
                    k: v for k, v in tokens[-1].items() if k != "text"
                }
                tokens[-1]["text"] += e["text"]
            else:
                tokens.append(dict(e))
    n = out["usage"]["completion_tokens"]
    assert [t["token"] for t in tokens] == list(range(n))  # every token, once, in order
    assert "".join(t["text"] for t in tokens) == out["text"]
    # one byte a token (byte_tokenizer): a character's text goes with its last byte, the tokens before it have none;
    # bytes that make no character show as U+FFFD once the next byte settles it, with that byte's own text
    odd = [(t["token"], t["text"]) for t in tokens if not re.fullmatch("\ufffd*.?", t["text"], re.S)]
    assert odd == []
    spec = out["speculation"]
    copied = Counter(t["source"] for t in tokens if t["source"] != "target")
    assert dict(copied) == {s: c["accepted"] for s, c in spec["sources"].items() if c["accepted"]}
    assert n - sum(copied.values()) == sum(1 for t in tokens if t["source"] == "target")
    steps = [t["step"] for t in tokens]
    assert steps == sorted(steps) and steps[0] == 1 and steps[-1] <= spec["target_forwards"]
    for step in set(steps):
        group = [t for t in tokens if t["step"] == step]
        guessed = sum(t["source"] != "target" for t in group)
        assert all(t["accepted"] == group[0]["accepted"] and t["drafted"] == group[0]["drafted"] for t in group)
        assert guessed <= group[0]["accepted"] <= group[0]["drafted"]
        assert all(t["source"] != "target" for t in group[:guessed])  # the accepted guesses come first in a pass
    assert sum(t["drafted"] for t in {t["step"]: t for t in tokens}.values()) <= spec["drafted"]
    return tokens


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("temperature", [0, 0.8])
@pytest.mark.parametrize("server", ["alone", "batched"])
def test_sources_add_up_to_the_answers_tokens(request, server, method, temperature):
    srv = request.getfixturevalue(server)
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 48,
        "temperature": temperature,
        "seed": 7,
        "speculation": {"method": method},
        "stream_options": {"include_sources": True},
    }
    out = stream(srv.url, body)
    tokens = check(out)
    sources = {t["source"] for t in tokens}
    if method == "autoregressive":
        assert sources == {"target"}
    if method in ("draft", "tree") and temperature == 0:
        assert "draft" in sources  # the draft is the target: its greedy guesses are kept
    if method in ("pld", "lookup") and temperature == 0:
        assert "context" in sources  # the prompt repeats itself
    plain = dict(body, stream_options=None)
    plain.pop("stream_options")
    again = stream(srv.url, plain)  # the same request without the extension: the same text, no sources
    if temperature == 0 or server == "alone":
        assert again["text"] == out["text"]
    assert "sources" in out["fields"] and "sources" not in again["fields"]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_stop_string_and_split_characters_keep_the_entries_aligned(alone, endpoint):
    """Bytes of one character in several tokens (their text goes with the token that completes it) and a stop string
    that cuts a pass: the entries still cut every chunk's text and name every token kept."""
    key = "prompt" if endpoint == "completions" else "messages"
    prompt = "héllo wörld ünïcödé " * 2
    value = prompt if endpoint == "completions" else [{"role": "user", "content": prompt}]
    body = {
        key: value,
        "max_tokens": 64,
        "speculation": {"method": "draft"},
        "stream_options": {"include_sources": True},
    }
    whole = stream(alone.url, body, endpoint)
    check(whole)
    assert any(t["text"] == "" for t in check(whole)[:-1])  # a character's first byte: a token with no text
    ascii_run = next(
        i
        for i in range(10, len(whole["text"]) - 3)
        if whole["text"][i : i + 3].isascii() and whole["text"][i : i + 3].isprintable()
    )
    stop = whole["text"][ascii_run : ascii_run + 3]
    cut = stream(alone.url, dict(body, stop=stop), endpoint)
    assert cut["text"] == whole["text"][: whole["text"].index(stop)]
    check(cut)


def test_an_earlier_output_is_lookup_unless_the_operator_shows_sources(make_engine):
    """With an output history, a copy of an earlier answer tells of other outputs: its tokens say "lookup" unless
    the server shows sources (--speculation-sources), as `speculation.sources` is hidden then too."""
    seen = {}
    for show in (False, True):
        srv = LiveServer(
            create_app(make_engine(0, None, history_tokens=4096), model_id=MODEL, method="lookup", show_sources=show)
        )
        try:
            body = {"prompt": "zq", "max_tokens": 40, "stream_options": {"include_sources": True}}
            stream(srv.url, body, "completions")
            out = stream(srv.url, body, "completions")  # the same again: the first answer is in the history
            seen[show] = Counter(e["source"] for _, entries in out["chunks"] for e in entries or [])
        finally:
            srv.stop()
    assert seen[True]["history"] > 0 and seen[True]["lookup"] == 0
    assert seen[False]["lookup"] == seen[True]["history"] and seen[False]["history"] == 0


def test_the_official_client_streams_with_sources(alone):
    client = openai.OpenAI(base_url=f"{alone.url}/v1", api_key="unused", max_retries=0, timeout=60)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True, "include_sources": True},
        )
    )
    entries = [e for c in chunks for choice in c.choices for e in (choice.model_extra.get("sources") or [])]
    assert "".join(e["text"] for e in entries) == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == len({e["token"] for e in entries})


def test_include_sources_must_be_a_boolean(alone):
    r = http.post(
        f"{alone.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"include_sources": "yes"},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.include_sources"
