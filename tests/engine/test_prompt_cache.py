"""The prompt cache (Engine(prompt_cache=True), prefill.py, LM.keep_prefix): a prompt that starts as the last one did
reads only what is new, with the output of a fresh read; only within one scope (an API key), never in exact mode, and
never after a generation that failed."""

import contextlib
import threading
import time

import pytest

from specdecode import Engine
from specdecode.errors import SpecDecodeError
from tiny import byte_tokenizer, tiny_model

FIRST = "the cat sat on the mat; the cat sat on the"


@pytest.fixture(scope="module", params=["torch", "llama.cpp"])
def engines(request, tmp_path_factory):
    """(with the prompt cache, without it) on the same weights."""
    tok = byte_tokenizer()
    if request.param == "torch":
        model = tiny_model(0)
        return Engine(model, tok, prompt_cache=True), Engine(model, tok)
    pytest.importorskip("llama_cpp")
    from specdecode.backends.llamacpp import LlamaLM
    from tinygguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path_factory.mktemp("prompt_cache") / "tiny.gguf", 0, hidden=128)
    return Engine(LlamaLM(gguf, threads=1), tok, prompt_cache=True), Engine(LlamaLM(gguf, threads=1), tok)


@pytest.mark.parametrize("method", ["autoregressive", "pld", "auto"])
def test_a_prompt_that_starts_as_the_last_reads_only_what_is_new(engines, method):
    cached, fresh = engines
    first = cached.generate(FIRST, method=method, max_new_tokens=12, cache_scope="k")
    turn = FIRST + first.text + " and then?"  # a conversation's next turn: the last text, then more
    second = cached.generate(turn, method=method, max_new_tokens=24, cache_scope="k")
    # the cache held the first prompt and its output but the last token (the loop keeps that one uncached); the
    # tiny model's bytes need not decode and encode back to themselves, so the prompts share what they share
    held, ids = cached.encode(FIRST) + first.token_ids[:-1], cached.encode(turn)
    common = next((i for i, (a, b) in enumerate(zip(held, ids)) if a != b), min(len(held), len(ids)))
    assert common >= len(cached.encode(FIRST)) and second.stats.cached_prompt_tokens == common
    assert second.token_ids == fresh.generate(turn, method=method, max_new_tokens=24).token_ids
    again = cached.generate(turn, method=method, max_new_tokens=24, cache_scope="k")  # the same prompt: all but
    assert again.stats.cached_prompt_tokens == len(cached.encode(turn)) - 1  # its last token, whose row is read
    assert again.token_ids == second.token_ids


def test_sampled_output_follows_the_seed_with_or_without_the_cache(engines):
    cached, fresh = engines
    cached.generate(FIRST, max_new_tokens=4, cache_scope="k")
    kw = dict(method="pld", temperature=1.0, seed=7, max_new_tokens=16)
    out = cached.generate(FIRST + " and", cache_scope="k", **kw)
    assert out.stats.cached_prompt_tokens > 0
    assert out.token_ids == fresh.generate(FIRST + " and", **kw).token_ids


def test_the_cache_is_reused_within_its_scope_only(engines):
    cached, _ = engines
    cached.generate(FIRST, max_new_tokens=4, cache_scope="alice")
    assert cached.generate(FIRST, max_new_tokens=4, cache_scope="bob").stats.cached_prompt_tokens == 0
    assert cached.generate(FIRST, max_new_tokens=4, cache_scope="bob").stats.cached_prompt_tokens > 0
    if cached.target.backend == "torch":  # (the tiny llama.cpp model is not loaded for exact mode)
        assert cached.generate(FIRST, max_new_tokens=4, cache_scope="bob", exact=True).stats.cached_prompt_tokens == 0
    assert cached.generate(FIRST, max_new_tokens=4).stats.cached_prompt_tokens == 0  # scope "" after "bob"
    _, fresh = engines
    fresh.generate(FIRST, max_new_tokens=4)
    assert fresh.generate(FIRST, max_new_tokens=4).stats.cached_prompt_tokens == 0  # off unless asked for


@pytest.mark.parametrize("error", [SpecDecodeError, KeyboardInterrupt])
def test_a_generation_that_fails_leaves_nothing_to_reuse(engines, monkeypatch, error):
    """An error inside a pass, or an interrupt (Ctrl-C may land inside a rollback, between the cache and its
    bookkeeping): the next prompt reads everything anew."""
    cached, fresh = engines
    cached.generate(FIRST, max_new_tokens=4, cache_scope="k")
    real, calls = cached.target.forward, [0]

    def flaky(*a, **k):
        calls[0] += 1
        if calls[0] == 3:  # a pass inside the steps, after the prompt was read
            raise error("injected failure")
        return real(*a, **k)

    monkeypatch.setattr(cached.target, "forward", flaky)
    with pytest.raises(error, match="injected"):
        cached.generate(FIRST + " x", method="autoregressive", max_new_tokens=8, cache_scope="k")
    monkeypatch.setattr(cached.target, "forward", real)
    out = cached.generate(FIRST + " x", method="autoregressive", max_new_tokens=8, cache_scope="k")
    assert out.stats.cached_prompt_tokens == 0
    assert out.token_ids == fresh.generate(FIRST + " x", method="autoregressive", max_new_tokens=8).token_ids


def test_the_server_reuses_a_prompt_for_the_same_api_key_only(make_engine):
    """`serve` (prompt cache on): the cached part shows in the response's speculation stats; a request with another
    key reads its prompt whole, so that its latency tells nothing of another client's text."""
    from helpers import LiveServer, http
    from specdecode.server import create_app

    tok = byte_tokenizer()
    engine = make_engine(draft=None, tokenizer=tok, prompt_cache=True)
    srv = LiveServer(create_app(engine, model_id="tiny", method="autoregressive", gamma=1))
    try:

        def cached(key: str) -> int:
            r = http.post(
                f"{srv.url}/v1/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": "tiny", "prompt": FIRST, "max_tokens": 4},
                timeout=60,
            )
            assert r.status_code == 200
            return r.json()["speculation"]["cached_prompt_tokens"]

        assert cached("alice") == 0
        assert cached("alice") == len(tok.encode(FIRST)) - 1
        assert cached("bob") == 0  # another key: its prompt read whole
        assert cached("bob") > 0
    finally:
        srv.stop()


@contextlib.contextmanager
def slot_server(tmp_path, n: int, adjust=None):
    """`serve --parallel n` (prompt cache on) on a tiny GGUF, live; yields ask(prompt, max_tokens) -> the response.
    adjust(slots) runs before the app is made."""
    pytest.importorskip("llama_cpp")
    from helpers import LiveServer, http
    from specdecode.backends.llamacpp import LlamaLM
    from specdecode.server import create_app
    from specdecode.slots import Slots
    from tinygguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", 0, hidden=128)
    engine = Engine(LlamaLM(gguf, threads=1), byte_tokenizer(), prompt_cache=True)
    engine.progress = False
    slots = Slots(engine, n)
    if adjust is not None:
        adjust(slots)
    live = LiveServer(create_app(engine, model_id="tiny", method="autoregressive", gamma=1, slots=slots))

    def ask(prompt: str, max_tokens: int = 4) -> dict:
        r = http.post(
            f"{live.url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}, timeout=60
        )
        assert r.status_code == 200
        return r.json()

    try:
        yield ask
    finally:
        live.stop()


def test_a_conversation_goes_back_to_the_slot_that_holds_it(tmp_path):
    """serve --parallel 3: three conversations, one after another, then each one's next turn while every slot is
    idle: each goes to the slot that holds its first turn and reads only what is new (by chance: 1 in 6)."""
    with slot_server(tmp_path, 3) as ask:
        firsts = [f"conversation {k}: " + "xyz " * (10 + 5 * k) for k in range(3)]
        for prompt in firsts:
            ask(prompt)
        for prompt in firsts[::-1]:  # one at a time, every slot idle when each arrives
            assert ask(prompt + "more")["speculation"]["cached_prompt_tokens"] >= len(prompt)


def test_conversations_arriving_at_once_go_back_to_their_slots(tmp_path):
    """serve --parallel 3: three conversations' next turns sent at the same moment, three times over: each goes to
    the slot that holds its earlier turns."""
    with slot_server(tmp_path, 3) as ask:
        talks = [f"conversation {k}: " + "xyz " * (10 + 5 * k) for k in range(3)]
        for prompt in talks:
            ask(prompt, 2)
        for turn in range(3):
            cached, go = [0] * 3, threading.Barrier(3)

            def send(k: int) -> None:
                go.wait()
                out = ask(talks[k] + f" turn {turn}", 2)
                cached[k] = out["speculation"]["cached_prompt_tokens"]
                talks[k] += f" turn {turn}" + out["choices"][0]["text"]

            threads = [threading.Thread(target=send, args=(k,)) for k in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert all(c >= len(t) - 12 for c, t in zip(cached, talks)), (turn, cached)


def test_a_next_turn_sent_at_once_finds_the_slot_that_just_answered(tmp_path, monkeypatch):
    """serve --parallel 2: a client that sends its next turn the moment the last answer ended finds that slot idle
    to the slot choice, though its worker is still closing the generation (here held 0.5 s): the turn reads only
    what is new, instead of going to the other idle slot and reading the whole conversation again."""

    def slow_to_close(slots):
        real = slots.generation

        @contextlib.contextmanager
        def generation():
            with real():
                yield
            time.sleep(0.5)  # the worker is busy after its generation ended

        monkeypatch.setattr(slots, "generation", generation)

    with slot_server(tmp_path, 2, slow_to_close) as ask:
        talk = "a conversation: " + "xyz " * 20
        for turn in range(3):
            out = ask(talk)
            if turn:
                assert out["speculation"]["cached_prompt_tokens"] >= len(talk) - 12, turn
            talk += out["choices"][0]["text"] + f" turn {turn}"


def test_load_and_serve_set_the_prompt_cache(tiny_dirs, monkeypatch):
    """Engine.load(prompt_cache=...) (what `serve` and `serve --ray` load with: on unless --no-prompt-cache)."""
    from specdecode.cli import build_parser

    target, _ = tiny_dirs
    assert Engine.load(str(target), with_draft=False, progress=False, prompt_cache=True).prompt_cache
    assert not Engine.load(str(target), with_draft=False, progress=False).prompt_cache
    parser = build_parser()
    assert parser.parse_args(["serve"]).no_prompt_cache is False
    assert parser.parse_args(["serve", "--no-prompt-cache"]).no_prompt_cache is True


def test_a_slot_copies_the_start_another_slot_holds(tmp_path):
    """Slots (llama.cpp, one shared cache): a prompt takes the longest start of it that any slot holds for its scope,
    copied into its own sequence, with the output of a fresh read; another scope's text is never copied; a slot in a
    generation shares only what it kept before reading its new prompt (the rest is not committed yet), and all of its
    text once the generation ended; a copy stays when its source moves on."""
    pytest.importorskip("llama_cpp")
    from specdecode.backends.llamacpp import LlamaLM
    from specdecode.slots import Slots
    from tinygguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", 0, hidden=128)
    engine = Engine(LlamaLM(gguf, threads=1), byte_tokenizer(), prompt_cache=True)
    engine.progress = False
    fresh = Engine(LlamaLM(gguf, threads=1), byte_tokenizer())
    e0, e1, e2 = Slots(engine, 3).engines
    system = "a system prompt that every request starts with; "
    kw = dict(method="autoregressive", max_new_tokens=6)

    def ask(e, prompt, scope="k"):
        out = e.generate(prompt, cache_scope=scope, **kw)
        assert out.token_ids == fresh.generate(prompt, **kw).token_ids
        return out.stats.cached_prompt_tokens

    def common(a: str, b: str) -> int:
        x, y = engine.encode(a), engine.encode(b)
        return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)) - 1)

    assert ask(e0, system + "first question") == 0
    assert ask(e1, system + "second question", "other") == 0  # another scope's text is not copied
    assert ask(e1, system + "second question") == common(system + "first question", system + "second question")
    ask(e1, "something else entirely")  # slot 1 holds nothing of the system prompt now
    third = system + "third question"
    stream = iter(e0.stream(third, cache_scope="k", **kw))
    next(stream)  # slot 0 is generating: it holds `third`, but shares only what it kept of its last text
    assert ask(e1, third) == common(system + "first question", third)
    assert ask(e2, "unrelated") == 0 and ask(e2, third) == len(engine.encode(third)) - 1  # from slot 1 (ended)
    ask(e1, "slot 1 moves on")
    for _ in stream:  # slot 0's generation ends
        pass
    assert ask(e1, third) == len(engine.encode(third)) - 1  # from slot 0 now, or slot 2
    ask(e0, "slot 0 moves on")
    ask(e2, "slot 2 moves on")  # the copies' sources dropped those cells; slot 1's own stay, with the same output
    assert ask(e1, third) == len(engine.encode(third)) - 1
