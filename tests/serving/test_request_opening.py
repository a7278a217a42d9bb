"""Opening a request (Service.open on Worker.open: tokenizing it) beside others: a big body holds one tokenizer copy
(lease.TokenizerCopies), not every request's, and bodies waiting to be tokenized hold places in the queue
(`--max-queue`)."""

import threading
import time

import pytest

from helpers import LiveServer, http
from specdecode import Engine
from specdecode.server import create_app, engine_lock
from tiny import build_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)

MODEL = "tiny"
BIG = "hello world " * 100_000  # 1.2 MB: tokenized, then refused as past the context


def post_in_thread(url, body, results, key):
    def run():
        try:
            results[key] = http.post(url, json=body, timeout=120)
        except Exception as e:  # noqa: BLE001 (the test reads it)
            results[key] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def wait_for(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.005)


@pytest.mark.parametrize("copies", [2, 1])
def test_a_small_request_is_not_held_up_by_a_big_body_being_tokenized(copies, monkeypatch):
    """While a 1.2 MB body is tokenized, a small request is answered in well under half that time: it encodes on
    another copy of the tokenizer. Negative control: with one copy (copies 1) it waits for the big body's."""
    separate = Engine.separate_encoder
    monkeypatch.setattr(Engine, "separate_encoder", lambda self, n=1: separate(self, min(n, copies)))
    engine = build_engine()
    srv = LiveServer(create_app(engine, model_id=MODEL, method="autoregressive", gamma=1))
    srv.app.state.service.token_chars = None  # no character pre-check: the big body is tokenized
    t0 = time.perf_counter()
    engine.tokenizer(BIG)
    tokenize_s = time.perf_counter() - t0
    results = {}
    try:
        big = post_in_thread(
            f"{srv.url}/v1/completions", {"model": MODEL, "prompt": BIG, "max_tokens": 4}, results, "big"
        )
        wait_for(lambda: srv.worker._opening == 1)  # admitted: its body is being tokenized
        time.sleep(min(0.05, tokenize_s / 10))
        t0 = time.perf_counter()
        small = http.post(
            f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 2}, timeout=60
        )
        small_s = time.perf_counter() - t0
        assert small.status_code == 200, small.text
        big.join(120)
        assert results["big"].status_code == 400  # tokenized, then refused: past the context
        if copies > 1:
            assert small_s < tokenize_s / 2, (small_s, tokenize_s)
        else:
            assert small_s > tokenize_s / 2, (small_s, tokenize_s)
    finally:
        srv.stop()


def test_bodies_waiting_to_be_tokenized_count_against_max_queue():
    """max_queue 1, the worker busy with one request: a big body being tokenized holds the one place, so the next
    request gets the full queue's 503 with Retry-After at once (it is not tokenized too and queued behind it); once the
    big body is gone, a request is queued again."""
    engine = build_engine()
    srv = LiveServer(create_app(engine, model_id=MODEL, method="autoregressive", gamma=1, max_queue=1))
    srv.app.state.service.token_chars = None
    url, results, threads = f"{srv.url}/v1/completions", {}, []
    lock = engine_lock(engine)
    try:
        with lock:  # the worker takes the first request and waits here, running
            threads.append(post_in_thread(url, {"model": MODEL, "prompt": "abc", "max_tokens": 2}, results, "run"))
            wait_for(lambda: srv.worker.busy)
            threads.append(post_in_thread(url, {"model": MODEL, "prompt": BIG, "max_tokens": 4}, results, "big"))
            wait_for(lambda: srv.worker._opening == 1)
            r = http.post(url, json={"model": MODEL, "prompt": "xyz", "max_tokens": 2}, timeout=60)
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
            assert int(r.headers["Retry-After"]) >= 1
            assert "big" not in results  # refused while the big body was still being tokenized
            wait_for(lambda: "big" in results, 120)
            assert results["big"].status_code == 400 and srv.worker._opening == 0
            threads.append(post_in_thread(url, {"model": MODEL, "prompt": "xyz", "max_tokens": 2}, results, "queued"))
            wait_for(lambda: srv.worker.queued == 1)  # the place is free again: queued behind the running one
        for t in threads:
            t.join(60)
        assert results["run"].status_code == results["queued"].status_code == 200
    finally:
        srv.stop()
