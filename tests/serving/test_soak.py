"""`specdecode loadtest --soak`: the load and fault test in its short form against a launched `serve --parallel 2` on
tiny GGUF models (loopback, under a minute of load, a SIGTERM and restart halfway), and the checker's criteria on
hand-made records, each with a negative control (a stream without its terminal event, a 500, a lost request...)."""

import asyncio
import json

import httpx
import pytest

from specdecode.cli import main
from specdecode.loadtest.client import one_request
from specdecode.loadtest.soak import KIND_WEIGHTS, Traffic, honest_body, malformed_bodies, request_key
from specdecode.loadtest.soak_check import check_greedy, error_code, judge, markdown, summary


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from tinygguf import write_tiny_gguf

    root = tmp_path_factory.mktemp("soak")
    return write_tiny_gguf(root / "t.gguf", 0, hidden=128), write_tiny_gguf(root / "d.gguf", 1)


@pytest.mark.process
def test_short_soak_against_a_launched_server(tiny_pair, tmp_path, monkeypatch, capsys):
    """Every kind of request sent, the server restarted halfway, every criterion judged and passed. Greedy answers
    may differ from alone at a near-tie of the top two logits, which these random models have often (measured: a
    gap of 0.003 at a first token), hence the tolerance; the latency floor absorbs a shared 2-core machine. 300
    requests (60 in the quiet run) leave about 70 sent while the server restarts, the rest before and after it."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    target, draft = tiny_pair
    out = tmp_path / "soak"
    code = main(
        [
            "loadtest",
            "--soak",
            "0.4",
            "--requests",
            "300",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--parallel",
            "2",
            "--concurrency",
            "4",
            "--threads",
            "1",
            "--max-tokens",
            "16",
            "--soak-timeout",
            "8",
            "--soak-long-chars",
            "300",
            "--ours-args=--max-tokens 24",
            "--soak-latency-floor-ms",
            "1500",
            "--soak-recheck",
            "60",
            "--ready-timeout",
            "120",
            "--out",
            str(out),
        ]
    )
    report = json.loads((out / "soak.json").read_text())
    criteria, summ = report["criteria"], report["summary"]
    assert code == 0, (out / "soak.md").read_text()
    assert all(c["pass"] for name, c in criteria.items() if name != "latency"), criteria
    assert criteria["latency"]["pass"] in (True, None)  # judged where both runs had five streams or more
    assert set(summ["by_kind"]) == {"honest", "disconnect", "deadline", "oversized", "malformed"}, summ["by_kind"]
    assert summ["restart"]["exit_code"] is not None and summ["restart"]["down_s"] > 0
    assert criteria["restart"]["during"] > 0 and criteria["greedy_alone"]["compared"] > 0
    assert criteria["idle_memory"]["rss_before_mib"] > 50 and "kv_cells" in criteria["idle_memory"]
    assert (out / "logs" / "serve-0.log").exists() and (out / "logs" / "serve-1.log").exists()
    md = (out / "soak.md").read_text()
    assert md.startswith("# Soak test: PASSED") and "| greedy_alone | pass |" in md
    assert "Soak test: PASSED" in capsys.readouterr().out


# -- the checker, on hand-made records ------------------------------------------------------------------------------
def rec(i, kind="honest", status=200, **kw):
    base = {
        "i": i,
        "kind": kind,
        "variant": kind,
        "status": status,
        "error": None,
        "text": "abc",
        "hung_up": False,
        "done": True,
        "finish_reason": "length",
        "spec_finish": None,
        "stream": True,
        "error_event": False,
        "refused": False,
        "generation": 0,
        "t_start": float(i),
        "t_end": i + 0.5,
        "ttft_s": 0.1,
        "itl_s": [0.01] * 5,
        "e2e_s": 0.5,
    }
    return {**base, **kw}


def soak_out(records, quiet=None, recheck=None, restart=None, idle=None):
    cfg = {"drift": 0.05, "latency_factor": 2.0, "latency_floor_s": 0.0, "minutes": 1, "concurrency": 2}
    quiet = quiet if quiet is not None else [rec(100 + i) for i in range(6)]
    return {
        "config": cfg,
        "records": records,
        "quiet": quiet,
        "recheck": recheck or [],
        "restart": restart,
        "idle": idle or {},
        "server_metrics": [],
        "model": "m",
    }


def failing(out) -> set[str]:
    return {name for name, c in judge(out).items() if c["pass"] is False}


def test_a_clean_run_passes_and_each_fault_fails_its_criterion():
    clean = [rec(i) for i in range(6)]
    assert failing(soak_out(clean)) == set()
    cut = rec(7, error="the stream ended without [DONE]", done=False)
    assert "terminal_events" in failing(soak_out(clean + [cut]))
    no_finish = rec(8, finish_reason=None)  # [DONE] without a finish_reason chunk before it
    assert "terminal_events" in failing(soak_out(clean + [no_finish]))
    error_event = rec(
        9,
        error='stream error event: {"message": "bye", "code": "shutting_down"}',
        done=False,
        error_event=True,
        finish_reason=None,
    )
    assert failing(soak_out(clean + [error_event])) == set()  # an error event is a terminal event
    crash = rec(
        10, status=500, error='HTTP 500: {"error": {"message": "internal server error", "code": "internal_error"}}'
    )
    busy = rec(11, status=503, error='HTTP 503: {"error": {"message": "busy", "code": "queue_full"}}')
    assert error_code(busy) == "queue_full" and error_code(crash) == "internal_error"
    assert failing(soak_out(clean + [busy])) == set()  # a documented 503
    assert "no_5xx" in failing(soak_out(clean + [crash]))
    assert "no_5xx" in failing(
        soak_out(
            clean + [rec(12, error='stream error event: {"code": "internal_error"}', error_event=True, done=False)]
        )
    )
    lost = rec(13, status=None, error="RemoteProtocolError: Server disconnected without sending a response.")
    assert "no_silent_loss" in failing(soak_out(clean + [lost]))
    accepted_malformed = rec(14, kind="malformed")
    assert "refusals" in failing(soak_out(clean + [accepted_malformed]))
    assert failing(soak_out(clean + [rec(15, kind="malformed", status=400, error="HTTP 400: {}")])) == set()


def test_restart_window_refusals_and_losses():
    restart = {"t_sigterm": 10.0, "t_exit": 10.5, "t_ready": 15.0, "exit_code": 0, "exit_s": 0.5, "down_s": 5.0}
    refused = rec(12, status=None, error="ConnectError: [Errno 111] Connection refused", refused=True)
    out = soak_out([rec(i) for i in range(5)] + [refused], restart=restart)
    assert failing(out) == set() and judge(out)["restart"]["outcomes"] == {"refused": 1}
    late_refusal = rec(30, status=None, error="ConnectError: refused", refused=True)  # the server should be up
    assert "no_silent_loss" in failing(soak_out([late_refusal], restart=restart))
    cut_at_restart = rec(11, error="ReadError: ", done=False, finish_reason=None)  # 200, then the stream broke
    assert {"restart", "terminal_events"} <= failing(soak_out([cut_at_restart], restart=restart))
    assert judge(soak_out([]))["restart"]["pass"] is None  # no restart: not judged


def test_a_connection_the_stopping_server_closed_unread_is_not_a_loss():
    """A request whose connection dropped without a status between the SIGTERM and a clean, timely exit was never
    read (a graceful exit answers every request it read); after the exit, or after an unclean or overdue exit, it
    is a loss."""
    restart = {"t_sigterm": 10.0, "t_exit": 10.5, "t_ready": 15.0, "exit_code": 0, "exit_s": 0.5, "down_s": 5.0}
    unread = rec(9, status=None, error="ReadError: ", done=False, finish_reason=None, t_start=9.9, t_end=10.2)
    out = soak_out([rec(i) for i in range(5)] + [unread], restart=restart)
    assert failing(out) == set() and judge(out)["restart"]["outcomes"] == {"closed unread": 1}
    assert failing(soak_out([unread], restart={**restart, "exit_code": -15})) == set()  # uvicorn re-raises SIGTERM
    assert {"no_silent_loss", "restart"} <= failing(soak_out([unread], restart={**restart, "exit_code": -9}))
    assert {"no_silent_loss", "restart"} <= failing(soak_out([unread], restart={**restart, "exit_s": 10.5}))
    late = {**unread, "t_start": 13.0, "t_end": 13.2}  # the old server had gone; nothing was listening to close it
    assert {"no_silent_loss", "restart"} <= failing(soak_out([late], restart=restart))
    assert "no_silent_loss" in failing(soak_out([unread]))  # no restart at all
    oversized = {**unread, "kind": "oversized"}  # a refusal the stopping server never read: not a refusal missed
    assert failing(soak_out([oversized], restart=restart)) == set()
    assert "refusals" in failing(soak_out([{**oversized, "t_end": 13.2}], restart=restart))  # control: too late


def test_the_checker_knows_the_servers_graceful_timeout():
    """An exit inside serve's graceful timeout (the constant uvicorn is given) explains a connection closed unread;
    one just past it does not."""
    from specdecode.server import GRACEFUL_SHUTDOWN_S

    unread = rec(9, status=None, error="ReadError: ", done=False, finish_reason=None, t_start=9.9, t_end=10.2)
    for exit_s, loss in ((GRACEFUL_SHUTDOWN_S - 0.5, False), (GRACEFUL_SHUTDOWN_S + 0.5, True)):
        restart = {
            "t_sigterm": 10.0,
            "t_exit": 10.0 + exit_s,
            "t_ready": 15.0 + exit_s,
            "exit_code": 0,
            "exit_s": exit_s,
            "down_s": 5.0,
        }
        assert ("no_silent_loss" in failing(soak_out([unread], restart=restart))) is loss, exit_s


def test_greedy_idle_and_latency_criteria():
    body = {"model": "m", "prompt": "p", "temperature": 0.0}
    key = request_key(body) + repr(None)
    under_load = rec(1, body=body, text="hello world")
    assert check_greedy([under_load], [{**rec(2), "key": key, "text": "hello world"}])["pass"] is True
    differs = check_greedy([under_load], [{**rec(2), "key": key, "text": "hello there"}])
    assert differs["pass"] is False and differs["cases"][0]["at_char"] == 6
    assert check_greedy([under_load], [{**rec(2), "key": key, "text": "hello there"}], tolerance=1.0)["pass"] is True
    assert check_greedy([under_load], [])["pass"] is None  # nothing compared: not judged
    idle = {
        "before": {"rss_mib": 100.0, "gauges": {"specdecode_queue_depth": 0.0}},
        "after": {"rss_mib": 104.0, "gauges": {"specdecode_queue_depth": 0.0}},
    }
    assert failing(soak_out([rec(1)], idle=idle)) == set()
    grown = {**idle, "after": {"rss_mib": 106.0, "gauges": {"specdecode_queue_depth": 0.0}}}
    stuck = {**idle, "after": {"rss_mib": 100.0, "gauges": {"specdecode_queue_depth": 2.0}}}
    assert "idle_memory" in failing(soak_out([rec(1)], idle=grown))
    assert "idle_memory" in failing(soak_out([rec(1)], idle=stuck))
    slow = [rec(i, ttft_s=0.5) for i in range(6)]  # quiet 0.1 s, soak 0.5 s: past 2x
    assert "latency" in failing(soak_out(slow))
    out = soak_out([rec(1), rec(2, status=500, error="HTTP 500: x")])
    criteria = judge(out)
    summ = summary(out, criteria)
    assert summ["passed"] is False and summ["by_status"] == {"200": 1, "500": 1}
    assert markdown(summ, criteria, out["config"]).startswith("# Soak test: FAILED")


def test_a_greedy_answer_parting_at_a_near_tie_passes_and_a_real_difference_fails():
    body = {"model": "m", "prompt": "p", "temperature": 0.0}
    alone = [{**rec(2), "key": request_key(body) + repr(None), "text": "hello there"}]
    parted = [rec(1, body=body, text="hello world")]
    near = {"1": {"gap": 0.04, "tie": 0.5, "near_tie": True}}
    res = check_greedy(parted, alone, ties=near)
    assert res["pass"] is True and res["mismatches"] == 1 and res["near_ties"] == 1 and res["max_gap"] == 0.04
    assert res["near_tie_cases"][0]["at_char"] == 6
    # negative controls: a gap past the tie tolerance, and a parting nobody scored, both fail
    real = check_greedy(parted, alone, ties={"1": {"gap": 3.2, "tie": 0.5, "near_tie": False}})
    assert real["pass"] is False and real["near_ties"] == 0 and real["cases"][0]["tie"]["gap"] == 3.2
    assert check_greedy(parted, alone, ties={})["pass"] is False
    out = soak_out(parted, quiet=[], recheck=alone)
    out["ties"] = near
    criteria = judge(out)
    assert criteria["greedy_alone"]["pass"] is True
    assert "parted at a near-tie" in markdown(summary(out, criteria), criteria, out["config"])


def test_partings_are_scored_by_the_target_alone(tiny_pair):
    """The gap is the target's own logit difference of the two parting tokens, after the prompt and the shared
    text, read in one context; near_tie says whether it is within the target's tie tolerance."""
    from specdecode import Engine
    from specdecode.loadtest.soak_ties import first_tokens_apart, score_partings

    assert first_tokens_apart([1, 2, 3], [1, 2, 4]) == 2 and first_tokens_apart([1, 2], [1, 2, 3]) is None
    target = str(tiny_pair[0])
    engine = Engine.load(target, None, backend="llama.cpp", with_draft=False, progress=False, threads=1)
    alone, under_load = "    return a + b\n", "    return b + a\n"
    a, b = engine.encode_prediction(alone), engine.encode_prediction(under_load)
    j = first_tokens_apart(list(a), list(b))
    assert j is not None
    for body, prompt_ids in (
        ({"prompt": "def add(a, b):"}, engine.encode("def add(a, b):")),
        ({"messages": [{"role": "user", "content": "add"}]}, None),
    ):
        if prompt_ids is None:
            if getattr(engine.encoder, "chat_template", None) is None:
                continue  # a tokenizer without a chat template: the completions case only
            prompt_ids = engine.encode(body["messages"], chat=True)
        logits = engine.target.forward(prompt_ids + list(a[:j]), last_only=True).reshape(-1).float()
        engine.target.reset()
        res = score_partings([{"i": 5, "body": body, "alone": alone, "under_load": under_load}], target, threads=1)["5"]
        assert res["tokens"] == [a[j], b[j]]
        assert res["gap"] == pytest.approx(float(logits[a[j]] - logits[b[j]]), abs=1e-3)
        assert res["near_tie"] == (abs(res["gap"]) <= res["tie"]) and res["tie"] == engine.target.tolerances()["tie"]
    same = score_partings([{"i": 6, "body": {"prompt": "x"}, "alone": alone, "under_load": alone}], target, threads=1)
    assert same["6"]["gap"] is None  # texts that do not part on a token are not scored
    body = {"prompt": "def add(a, b):"}
    twice = score_partings(
        [{"i": i, "body": body, "alone": alone, "under_load": under_load} for i in (7, 8)]
        + [{"i": 9, "body": body, "alone": under_load, "under_load": alone}],
        target,
        threads=1,
    )
    assert twice["7"] == twice["8"] and twice["7"] is not twice["8"]  # scored once, reported for each
    assert twice["9"]["gap"] == pytest.approx(-twice["7"]["gap"], abs=1e-3)  # the other way round: scored again


def test_a_stop_cut_token_is_any_the_text_and_the_stops_allow():
    """The server cuts the text before a stop string, so a shown `:` may have been `:\n\n`; a token past the stop's
    start, or one that does not begin with the shown text, may not."""
    from specdecode.loadtest.soak_ties import cut_by_stop

    pieces = [":", ":\n", ":\n\n", ".", ":x", "a:", ":ret", ": return", ":return 1"]
    assert cut_by_stop(":", pieces, ["\n"]) == [0, 1, 2]
    assert cut_by_stop(":", pieces, ["\n", "return"]) == [0, 1, 2, 6, 8]
    assert cut_by_stop(".", pieces, ["\n"]) == [3]


def test_a_parting_on_a_stop_cut_token_is_scored_on_the_best_token_the_text_allows(tiny_pair):
    """Where one answer was cut by a stop string right at the parting, its side is the best-scored token whose text
    begins with what is shown and goes on into a stop; without the stop (control) it is the re-encoded token."""
    from specdecode import Engine
    from specdecode.loadtest.soak_ties import cut_by_stop, first_tokens_apart, score_partings

    target = str(tiny_pair[0])
    engine = Engine.load(target, None, backend="llama.cpp", with_draft=False, progress=False, threads=1)
    body = {"prompt": "def add(a, b):", "stop": ["\n"]}
    alone, under_load = "    return a:", "    return a. b"
    a, b = engine.encode_prediction(alone), engine.encode_prediction(under_load)
    j = first_tokens_apart(list(a), list(b))
    assert j == len(a) - 1
    logits = engine.target.forward(engine.encode(body["prompt"]) + list(a[:j]), last_only=True).reshape(-1).float()
    engine.target.reset()
    pieces = [engine.decode([t]) for t in range(int(logits.shape[0]))]
    options = cut_by_stop(engine.decode(list(a[j:])), pieces, ["\n"])
    best = max(options, key=lambda t: float(logits[t]))
    pair = {"i": 1, "body": body, "alone": alone, "under_load": under_load, "under_load_finish": "length"}
    cut = score_partings([{**pair, "alone_finish": "stop"}], target, threads=1)["1"]
    assert cut["tokens"] == [best, b[j]] and cut["stop_cut"] == [True, False]
    assert cut["gap"] == pytest.approx(float(logits[best] - logits[b[j]]), abs=1e-3)
    plain = score_partings([{**pair, "alone_finish": "length"}], target, threads=1)["1"]  # control: not cut
    assert plain["tokens"] == [a[j], b[j]] and "stop_cut" not in plain
    both = score_partings(
        [{**pair, "alone_finish": "stop", "under_load": alone, "under_load_finish": "stop"}], target, threads=1
    )["1"]
    assert both["gap"] is None  # the same text on both sides does not part


def fake_transport(events: list[str], status: int = 200):
    async def handler(request):
        async def stream():
            for line in events:
                yield (line + "\n\n").encode()

        return httpx.Response(status, content=stream(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_the_client_sees_a_stream_without_its_terminal_event():
    """Negative control through the client: a stream cut after a text chunk is an error and fails terminal_events;
    the same stream with its finish_reason chunk and [DONE] passes."""
    chunk = 'data: {"choices": [{"index": 0, "text": "x", "finish_reason": null}]}'
    final = 'data: {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}'

    async def send(events):
        async with httpx.AsyncClient(transport=fake_transport(events)) as client:
            body = {"model": "m", "prompt": "p", "stream": True}
            got = await one_request(client, "http://fake", "m", {"id": "a"}, 0, body=body)
            return {**rec(1), **got, "stream": True}

    cut = asyncio.run(send([chunk]))
    whole = asyncio.run(send([chunk, final, "data: [DONE]"]))
    assert cut["error"] == "the stream ended without [DONE]" and not cut["done"]
    assert whole["error"] is None and whole["done"] and whole["finish_reason"] == "stop"
    assert "terminal_events" in failing(soak_out([cut])) and failing(soak_out([whole])) == set()


def test_the_mix_covers_every_kind_of_request():
    import random

    rng = random.Random(0)
    variants = {honest_body(rng, {"id": "x", "prompt": "p", "chat": False}, "m", 8, {})[0] for _ in range(300)}
    for part in ("chat", "completions", "greedy", "sampled", "stream", "json", "stop", "max_tokens", "prediction"):
        assert any(part in v.split("/") for v in variants), part
    assert len(malformed_bodies("m")) >= 12

    async def kinds():
        async with httpx.AsyncClient(transport=fake_transport([], status=400)) as client:
            traffic = Traffic(
                client,
                "http://fake",
                "m",
                seed=1,
                prompts=[{"id": "x", "prompt": "p"}],
                max_tokens=4,
                long_chars=50,
                too_long_chars=100,
                state={},
            )
            return [await traffic.next(kind) for kind in ("honest", "disconnect", "deadline", "oversized", "malformed")]

    got = asyncio.run(kinds())
    assert [r["kind"] for r in got] == ["honest", "disconnect", "deadline", "oversized", "malformed"]
    assert all(r["i"] == n + 1 for n, r in enumerate(got))
    assert [r["variant"].split("/")[0] for r in got[1:]] == ["disconnect", "deadline", "oversized", "malformed"]


def test_the_kinds_of_request_are_a_table_the_weights_name():
    """Each kind is sent by the function its table names (no method looked up by its name): the mix's weights name
    only kinds in the table, and an unknown kind is refused with the known ones, before anything is sent."""
    assert set(KIND_WEIGHTS) == set(Traffic.KINDS) and all(callable(f) for f in Traffic.KINDS.values())
    with pytest.raises(ValueError, match="unknown kind.*honest"):
        Traffic(
            None,
            "http://fake",
            "m",
            seed=1,
            prompts=[],
            max_tokens=4,
            long_chars=50,
            too_long_chars=100,
            state={},
            weights={"honest": 1.0, "_raw": 0.1},
        )
    traffic = Traffic(
        None, "http://fake", "m", seed=1, prompts=[], max_tokens=4, long_chars=50, too_long_chars=100, state={}
    )
    with pytest.raises(ValueError, match="unknown kind of request '_send'"):
        asyncio.run(traffic.next("_send"))
    assert traffic.sent == 0
