"""`specdecode loadtest`: the load client's statistics on a fake server and a fake clock, the client
against our server at concurrency 1 and 3 (loopback only, a handful of requests), and the launch of a peer."""

import asyncio
import json
import sys

import httpx
import pytest
import torch

from helpers import LiveServer
from specdecode.cli import main
from specdecode.launch.llama_server import find_binary
from specdecode.launch.servers import llama_cpp_server_missing, peer_argv
from specdecode.loadtest.client import (
    first_difference,
    greedy_mismatches,
    level_rows,
    measure_server,
    percentile,
    run_level_async,
)
from specdecode.server import create_app, engine_lock

MODEL = "tiny"


# -- statistics, on a fake server and a fake clock -------------------------------------------------------------------
def test_percentile_is_linear_between_order_statistics():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile(range(101), 99) == 99
    assert percentile([0, 10], 99) == pytest.approx(9.9)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def fake_server(clock, scripts):
    """An httpx transport: scripts[prompt] is (status, [(seconds before the event, event line), ...])."""

    async def handler(request):
        body = json.loads(request.content)
        status, events = scripts[body.get("prompt") or body["messages"][0]["content"]]

        async def stream():
            for delay, line in events:
                clock.t += delay
                yield (line + "\n\n").encode()

        return httpx.Response(status, content=stream(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def sse(obj):
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj))


def completion_events(pieces, usage=True):
    out = [(dt, sse({"choices": [{"index": 0, "text": text, "finish_reason": None}]})) for dt, text in pieces]
    out.append((0.0, sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})))
    if usage:
        out.append((0.0, sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": len(pieces) + 1}})))
    return out + [(0.0, sse("[DONE]"))]


def test_statistics_of_a_level_on_a_fake_clock():
    clock = FakeClock()
    scripts = {
        # TTFT 0.5 s, then chunks 0.1 and 0.3 s apart; usage says 4 tokens (one chunk carried two)
        "a": (200, completion_events([(0.5, "x"), (0.1, "yz"), (0.3, "w")])),
        # TTFT 1.0 s, one gap of 0.2 s; no usage chunk: tokens are counted as text chunks
        "b": (200, completion_events([(1.0, "p"), (0.2, "q")], usage=False)),
        "busy": (503, [(0.0, '{"error": {"message": "queue full"}}')]),
        "cut": (200, [(0.1, sse({"choices": [{"index": 0, "text": "t"}]}))]),  # no [DONE]
        "boom": (200, [(0.1, sse({"error": {"message": "internal"}})), (0.0, sse("[DONE]"))]),
    }
    rows = [{"id": k, "prompt": k, "chat": False} for k in scripts]
    summary, records = asyncio.run(
        run_level_async("http://fake", MODEL, rows, 1, 8, clock=clock, transport=fake_server(clock, scripts))
    )
    by = {r["id"]: r for r in records}
    assert by["a"]["text"] == "xyzw" and by["a"]["tokens"] == 4 and by["a"]["chunks"] == 3
    assert by["a"]["ttft_s"] == pytest.approx(0.5) and by["a"]["itl_s"] == pytest.approx([0.1, 0.3])
    assert by["a"]["tpot_s"] == pytest.approx(0.4 / 3) and by["a"]["finish_reason"] == "length"
    assert by["b"]["tokens"] == 2 and by["b"]["usage_tokens"] is None and by["b"]["ttft_s"] == pytest.approx(1.0)
    assert by["busy"]["status"] == 503 and "queue full" in by["busy"]["error"]
    assert "without [DONE]" in by["cut"]["error"] and "stream error event" in by["boom"]["error"]
    assert summary["requests"] == 5 and summary["ok"] == 2 and summary["errors"] == 3 and summary["errors_5xx"] == 1
    assert summary["completion_tokens"] == 6
    assert summary["wall_s"] == pytest.approx(0.9 + 1.2 + 0.1 + 0.1)  # one client: the requests back to back
    assert summary["tokens_per_s"] == pytest.approx(6 / 2.3)
    assert summary["ttft_p50_s"] == pytest.approx(0.75) and summary["ttft_p99_s"] == pytest.approx(0.995)
    assert summary["itl_p50_s"] == pytest.approx(0.2) and summary["itl_p99_s"] == pytest.approx(0.298)


def test_chat_rows_go_to_chat_completions_and_greedy_mismatches_are_located():
    clock = FakeClock()
    chunk = lambda text: (0.1, sse({"choices": [{"index": 0, "delta": {"content": text}}]}))  # noqa: E731
    scripts = {
        "hi": (
            200,
            [
                (0.0, sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})),
                chunk("Hel"),
                chunk("lo!"),
                (0.0, sse("[DONE]")),
            ],
        )
    }
    rows = [{"id": "1", "prompt": "hi", "chat": True}]
    _, records = asyncio.run(
        run_level_async("http://fake", MODEL, rows, 1, 8, clock=clock, transport=fake_server(clock, scripts))
    )
    assert records[0]["error"] is None and records[0]["text"] == "Hello!" and records[0]["ttft_s"] == pytest.approx(0.1)
    assert first_difference("abc", "abc") is None and first_difference("abc", "abd") == 2
    assert first_difference("abc", "ab") == 2
    got = greedy_mismatches({"1": "Hello!", "2": "x"}, records + [{**records[0], "text": "Help!"}], 2)
    assert [(m["id"], m["at_char"]) for m in got] == [("1", 3)]
    assert [r["id"] for r in level_rows(rows * 2, 3, None)] == ["1", "1", "1"]


def test_llama_server_peer_command(tmp_path):
    gguf, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    gguf.write_bytes(b"GGUF")
    draft.write_bytes(b"GGUF")
    kw = dict(
        port=1234, slots=4, threads=2, ctx=4096, target=str(gguf), draft=str(draft), llama_server="ls", serve_flags=()
    )
    plain = peer_argv("llama-server", **kw)
    assert plain[:3] == ["ls", "-m", str(gguf)] and "--spec-type" not in plain
    flags = " ".join(plain)
    assert "-t 2 -tb 2 -np 4 -kvu -c 16384" in flags and "--host 127.0.0.1 --port 1234" in flags
    assert " ".join(peer_argv("llama-server-draft", **kw)).endswith(
        f"--spec-type draft-simple -md {draft} -td 2 -tbd 2"
    )
    assert " ".join(peer_argv("llama-server-ngram", **kw)).endswith(
        "-np 4 -kvu -c 16384 --no-webui --spec-type ngram-mod"
    )
    assert " ".join(peer_argv("llama-server-ngram-simple", **kw)).endswith(
        "--no-webui --spec-type ngram-simple --spec-ngram-simple-size-n 4 --spec-ngram-simple-size-m 16"
    )
    assert " ".join(peer_argv("llama-server-ngram-simple-64", **kw)).endswith("--spec-ngram-simple-size-m 64")
    ours = peer_argv("specdecode", **kw)
    assert ours[1:4] == ["-m", "specdecode", "serve"] and "--parallel" not in ours and "--ctx-size" not in ours
    flags = ("--parallel", "--ctx-size")
    assert peer_argv("specdecode-p1", **{**kw, "serve_flags": flags})[-2:] == ["--parallel", "1"]
    assert peer_argv("specdecode-p1", **{**kw, "serve_flags": flags, "ours_ctx": True})[-2:] == ["--ctx-size", "4096"]
    assert peer_argv("specdecode", **{**kw, "serve_flags": flags})[-2:] == ["--parallel", "4"]
    lcp = " ".join(peer_argv("llama-cpp-python", **kw))  # one sequence of CTX tokens, whatever the slots
    assert lcp.split()[1:3] == ["-m", "llama_cpp.server"] and f"--model {gguf}" in lcp and "--port 1234" in lcp
    assert "--n_threads 2 --n_threads_batch 2 --n_ctx 4096 --interrupt_requests False" in lcp


def test_llama_cpp_python_peer_without_its_server_packages(monkeypatch, tmp_path, capsys):
    """The peer's missing pure-Python packages are named (with the pip command) before anything starts."""
    import specdecode.launch.servers as servers

    monkeypatch.setattr(servers, "llama_cpp_server_missing", lambda: ["sse-starlette", "starlette-context<0.4"])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n")
    assert main(["loadtest", "--launch", "llama-cpp-python", "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert "llama-cpp-python" in err and "pip install sse-starlette 'starlette-context<0.4'" in err


# -- the client against our server ---------------------------------------------------------------------------------
def test_load_on_our_server_loses_nothing_and_answers_as_alone(tiny_engine):
    """Concurrency 1 and 3: no 5xx, every response complete (its text and token count those of the same
    request generated alone by the engine), and the greedy check finds nothing."""
    torch.set_num_threads(1)
    prompts = [{"id": str(i), "prompt": f"request {i}: {'abc' * i}", "chat": i % 3 == 2} for i in range(6)]
    refs = {}
    for row in prompts:
        prompt = [{"role": "user", "content": row["prompt"]}] if row["chat"] else row["prompt"]
        with engine_lock(tiny_engine):
            r = tiny_engine.generate(prompt, method="draft", gamma=3, max_new_tokens=12)
        refs[row["id"]] = (r.text, r.stats.new_tokens)
    live = LiveServer(create_app(tiny_engine, model_id=MODEL, method="draft", gamma=3))
    try:
        got = measure_server(live.url, prompts, [1, 3], max_tokens=12, timeout=60, log=lambda msg: None)
    finally:
        live.stop()
    assert [s["concurrency"] for s in got["levels"]] == [1, 3]
    for s in got["levels"]:
        assert s["requests"] == 6 and s["ok"] == 6 and s["errors"] == 0 and s["errors_5xx"] == 0, s
        assert s["completion_tokens"] == sum(n for _, n in refs.values()) and s["tokens_per_s"] > 0
        assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"] and s["itl_p50_s"] <= s["itl_p99_s"]
    assert got["mismatches"] == [] and got["levels"][1]["greedy_compared"] == 6
    assert got["solo"] == {k: text for k, (text, _) in refs.items()}
    for r in got["requests"]:
        assert r["status"] == 200 and r["error"] is None and r["usage_tokens"] == refs[r["id"]][1]
        assert r["finish_reason"] in ("length", "stop")


# a second round of the same load on the same server may hold this much more memory at its peak than the first
# (allocator arenas, lazily built caches); a leak per request or per token would grow past it
LEAK_MARGIN_MIB, LEAK_MARGIN_FRACTION = 32.0, 0.05


@pytest.mark.process
def test_loadtest_command_launches_our_server(tiny_dirs, tmp_path, capsys):
    """`specdecode loadtest --launch specdecode --rounds 2`: a fresh server on a free port, the same load run
    twice on it, stopped; the JSON, markdown and plot written; the server's memory bounded (the second
    round's peak RSS not above the first's beyond the margin). (One level: each level starts its own server,
    a model load each.)"""
    target, draft = tiny_dirs
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    assert (
        main(
            [
                "loadtest",
                "--launch",
                "specdecode",
                "--target",
                str(target),
                "--draft",
                str(draft),
                "--prompts",
                str(prompts),
                "--concurrency",
                "1",
                "--max-tokens",
                "8",
                "--threads",
                "1",
                "--requests",
                "12",
                "--rounds",
                "2",
                "--ours-args",
                "--method draft --gamma 3 --history-tokens 0",
                "--ready-timeout",
                "120",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads((out / "loadtest.json").read_text())
    levels = results["servers"]["specdecode"]["levels"]
    assert [(s["concurrency"], s["round"], s["ok"], s["errors"]) for s in levels] == [(1, 1, 12, 0), (1, 2, 12, 0)]
    assert levels[1]["greedy_compared"] == 12 and levels[1]["greedy_mismatches"] == 0  # round 2 answers as round 1
    assert results["servers"]["specdecode"]["commands"]["1"].split()[2:4] == ["specdecode", "serve"]
    md = (out / "loadtest.md").read_text()
    assert (out / "loadtest.png").stat().st_size > 0 and "| specdecode | 1 | 12/12 |" in md
    assert "| specdecode | 1 (round 2) | 12/12 |" in md and "| specdecode | 1 | 12/12 |" in capsys.readouterr().out
    assert "serving" in (out / "logs" / "specdecode-c1.log").read_text()
    first, second = (s["memory"] for s in levels)
    for m in (first, second):  # a Python server with torch holds well over 50 MiB; the samples ran
        assert m["rss_before_mib"] > 50 and m["rss_peak_mib"] >= m["rss_before_mib"] and m["samples"] >= 2, m
    bound = first["rss_peak_mib"] * (1 + LEAK_MARGIN_FRACTION) + LEAK_MARGIN_MIB
    assert second["rss_peak_mib"] <= bound, (
        f"server RSS (process and children, sampled every {first['interval_s']} s) peaked at "
        f"{second['rss_peak_mib']} MiB in round 2 of the same 12 requests against {first['rss_peak_mib']} MiB in "
        f"round 1 (before: {first['rss_before_mib']} / {second['rss_before_mib']} MiB): more than the allowed "
        f"{LEAK_MARGIN_FRACTION:.0%} + {LEAK_MARGIN_MIB:.0f} MiB ({bound:.0f} MiB)"
    )


def test_rss_of_a_process_tree_and_the_sampler():
    """rss_bytes counts a process's children; the sampler keeps before, peak, after."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from specdecode.loadtest.procmem import MemorySampler, rss_bytes

    _proc_rss = lambda pid: psutil.Process(pid).memory_info().rss  # noqa: E731  (the process alone)
    child = "x = b'x' * (96 << 20); import time; time.sleep(60)"  # 96 MiB touched: resident
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)",
        ],
        start_new_session=True,
    )  # its own process group: killed with its child below
    try:
        deadline = time.monotonic() + 20
        while rss_bytes(parent.pid) - _proc_rss(parent.pid) < 96 << 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        total, own = rss_bytes(parent.pid), _proc_rss(parent.pid)
        assert total - own >= 96 << 20, (total, own)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
    assert rss_bytes(parent.pid) is None  # gone
    values = iter([100 << 20, 300 << 20, 200 << 20] + [150 << 20] * 1000)
    with MemorySampler(1, interval=0.01, read=lambda pid: next(values)) as mem:
        time.sleep(0.1)
    got = mem.result()
    assert got["rss_before_mib"] == 100 and got["rss_peak_mib"] == 300 and got["rss_after_mib"] == 150
    assert got["samples"] >= 4


LLAMA_SERVER = find_binary("llama-server")  # read at import: the tests' cache is a temporary one


@pytest.mark.process
@pytest.mark.skipif(LLAMA_SERVER is None, reason="llama-server not built (specdecode loadtest --build-llama-server)")
def test_llama_server_peers_on_a_tiny_gguf(tmp_path, capsys):
    """llama.cpp's own server, plain and with the draft model, launched per level on a free port and measured."""
    from tinygguf import write_tiny_gguf

    target, draft = write_tiny_gguf(tmp_path / "t.gguf", 0), write_tiny_gguf(tmp_path / "d.gguf", 1)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    assert (
        main(
            [
                "loadtest",
                "--launch",
                "llama-server,llama-server-draft",
                "--llama-server",
                str(LLAMA_SERVER),
                "--target",
                str(target),
                "--draft",
                str(draft),
                "--prompts",
                str(prompts),
                "--concurrency",
                "2",
                "--max-tokens",
                "8",
                "--threads",
                "1",
                "--ctx-size",
                "128",
                "--ready-timeout",
                "60",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads((out / "loadtest.json").read_text())
    for name in ("llama-server", "llama-server-draft"):
        srv = results["servers"][name]
        assert [(s["concurrency"], s["ok"], s["errors"]) for s in srv["levels"]] == [(1, 3, 0), (2, 3, 0)], srv
        assert all(r["usage_tokens"] == 8 for r in srv["requests"])
        assert "-np 2 -kvu -c 256" in srv["commands"]["2"]
    assert "--spec-type draft-simple" in results["servers"]["llama-server-draft"]["commands"]["1"]
    said = "".join(capsys.readouterr())
    order = [
        said.index(f"{n}, concurrency {c}:")
        for c, names in ((1, ("llama-server", "llama-server-draft")), (2, ("llama-server-draft", "llama-server")))
        for n in names
    ]
    assert order == sorted(order)  # level by level, the peers of a level back to back (the machine drifts), each
    # level starting one peer later (no peer always first)


LLAMA_CPP_SERVER_MISSING = llama_cpp_server_missing()


@pytest.mark.process
@pytest.mark.skipif(
    bool(LLAMA_CPP_SERVER_MISSING),
    reason=f"llama-cpp-python's server needs {', '.join(LLAMA_CPP_SERVER_MISSING)} (pip install -e '.[test]')",
)
def test_llama_cpp_python_server_as_a_reference_peer(tmp_path, capsys):
    """`--launch llama-cpp-python`: its own server on a tiny GGUF, ready on /v1/models, streamed completions back
    through the load harness at concurrency 1 and 2 (one at a time behind its lock: none cut off), memory read."""
    from tinygguf import write_tiny_gguf

    target = write_tiny_gguf(tmp_path / "t.gguf", 0)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    assert (
        main(
            [
                "loadtest",
                "--launch",
                "llama-cpp-python",
                "--target",
                str(target),
                "--prompts",
                str(prompts),
                "--concurrency",
                "2",
                "--max-tokens",
                "8",
                "--threads",
                "1",
                "--ctx-size",
                "128",
                "--ready-timeout",
                "60",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    srv = json.loads((out / "loadtest.json").read_text())["servers"]["llama-cpp-python"]
    assert [(s["concurrency"], s["ok"], s["errors"]) for s in srv["levels"]] == [(1, 3, 0), (2, 3, 0)], srv
    assert all(r["status"] == 200 and r["chunks"] >= 1 and r["finish_reason"] for r in srv["requests"]), srv["requests"]
    assert srv["levels"][1]["greedy_compared"] == 3
    assert all(s["memory"]["rss_peak_mib"] > 0 for s in srv["levels"])
    assert "--n_ctx 128 --interrupt_requests False" in srv["commands"]["2"]
    assert "| llama-cpp-python | 2 | 3/3 |" in capsys.readouterr().out


@pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="psutil's thread ids are the threads' native ids on Linux only (Mach ids on macOS)",
)
def test_thread_cpu_splits_the_busiest_threads_from_the_rest():
    """Per-thread CPU over a round: the `compute` busiest threads apart from the others (new threads from zero;
    an ended thread's time is kept in the processes' total)."""
    import os
    import threading
    import time

    from specdecode.loadtest.procmem import cpu_split, thread_cpu

    before, done = thread_cpu(os.getpid()), threading.Event()

    def busy():
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        done.wait()  # alive (and counted) until read

    spin = threading.Thread(target=busy)
    spin.start()
    time.sleep(0.05)
    deadline = time.monotonic() + 30
    while spin.native_id not in thread_cpu(os.getpid()) or thread_cpu(os.getpid())[spin.native_id][1] < 0.25:
        assert time.monotonic() < deadline, "the spinning thread never showed 0.25 s of CPU"
        time.sleep(0.05)
    after = thread_cpu(os.getpid())
    done.set()
    spin.join()
    assert spin.native_id in after and spin.native_id not in before
    split, spun = cpu_split(before, after, 1), round(after[spin.native_id][1], 3)
    # the busiest thread: the spinner, unless another thread or child process of this (xdist worker) process spent more
    # in the same window (seen once in the fast lane under its own load); either way at least the spinner's time, and
    # the spinner among the busiest listed
    assert split["compute_cpu_s"] >= max(0.1, spun)
    assert any(seconds == spun for _, seconds in split["busiest"])
    assert cpu_split(None, after, 1) is None and thread_cpu(2**22 + 7) is None
    # the spinner has ended: its time stays in the total, outside the busiest (join returns before the kernel has
    # removed the thread: its task can still be listed for a moment)
    deadline = time.monotonic() + 30
    while spin.native_id in (ended := thread_cpu(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert spin.native_id not in ended and cpu_split(before, ended, 0)["other_cpu_s"] >= 0.25
    made = cpu_split({1: ("a", 1.0), 2: ("b", 2.0)}, {1: ("a", 4.0), 2: ("b", 2.5), 3: ("c", 0.25)}, 1)
    assert made == {
        "compute_threads": 1,
        "compute_cpu_s": 3.0,
        "other_cpu_s": 0.75,
        "busiest": [["a", 3.0], ["b", 0.5], ["c", 0.25]],
    }


def test_like_for_like_compares_requests_of_equal_length_only():
    """Per level, the first server's summed time over another's, over the first round's requests both answered
    with the same number of tokens (texts that end elsewhere are different work)."""
    from specdecode.loadtest.report import like_for_like, markdown

    def req(i, tokens, e2e, c=1, r=1):
        return {"id": i, "concurrency": c, "round": r, "tokens": tokens, "e2e_s": e2e, "error": None}

    a = [
        req("p", 128, 4.0),
        req("q", 128, 5.0),
        req("s", 60, 1.0),
        req("p", 128, 9.0, c=4),
        req("p", 128, 1.0, r=2),
        req("p", 100, 2.0),
    ]  # the same prompt again in the round: paired with the other's second answer to it
    b = [
        req("p", 128, 5.0),
        req("q", 128, 5.0),
        req("s", 90, 3.0),
        req("p", 128, 6.0, c=4),
        req("p", 128, 9.0, r=2),
        {**req("t", 128, 1.0), "error": "HTTP 500"},
        req("p", 100, 3.0),
    ]
    results = {
        "servers": {
            "A": {"requests": a, "levels": [], "mismatches": []},
            "B": {"requests": b, "levels": [], "mismatches": []},
        }
    }
    lines = like_for_like(results)
    assert lines == [
        "",
        "B, requests of the same length as A's: c = 1: A / B time 0.846 over 3, c = 4: A / B time 1.500 over 1",
    ]
    assert like_for_like({"servers": {"A": results["servers"]["A"]}}) == []
    results["config"] = {"max_tokens": 128, "prompts": ["x"], "n_prompts": 3, "requests": None}
    assert lines[1] in markdown(results)
