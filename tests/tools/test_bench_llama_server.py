"""`specdecode bench --methods ...,llama-server,llama-server-draft,llama-server-ngram`: llama.cpp's own
server as a single-stream peer. The argument checks and the error without the binary (fast, before any model);
the whole path (launch, /completion streamed, tokens, TTFT, stop) through a stand-in server
(fake_llama_server.py: llama-cpp-python's greedy generation in llama-server's stream format); and, where
llama-server is built, the real one."""

import json
import os
import sys
from pathlib import Path

import pytest

from specdecode.cli import main
from specdecode.launch.llama_server import find_binary

LLAMA_SERVER = find_binary("llama-server")  # read at import: the tests' cache is a temporary one
FAKE = Path(__file__).resolve().parents[1] / "fake_llama_server.py"


@pytest.fixture
def prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"prompt": "def add(a, b):", "category": "code"}\n{"prompt": "abcabcabc abcabcabc", "category": "text"}\n'
    )
    return f


def test_llama_server_peers_checked_before_any_model(tmp_path, prompts, monkeypatch, capsys):
    """Without the binary: exit 2 naming `specdecode loadtest --build-llama-server`, before the (here missing)
    model is looked at; a missing --llama-server file and sampling are refused as early."""
    import specdecode.launch.llama_server as ls

    monkeypatch.setattr(ls, "find_binary", lambda *a, **k: None)
    missing_model = str(tmp_path / "no-such-model.gguf")
    for methods in ("llama-server", "autoregressive,llama-server-draft", "llama-server-ngram"):
        assert main(["bench", "--prompts", str(prompts), "--methods", methods, "--target", missing_model]) == 2
        err = capsys.readouterr().err
        assert "llama-server" in err and "specdecode loadtest --build-llama-server" in err, err
    assert (
        main(
            [
                "bench",
                "--prompts",
                str(prompts),
                "--methods",
                "llama-server",
                "--target",
                missing_model,
                "--llama-server",
                str(tmp_path / "nope"),
            ]
        )
        == 2
    )
    assert "no such file" in capsys.readouterr().err
    assert (
        main(
            [
                "bench",
                "--prompts",
                str(prompts),
                "--methods",
                "llama-server",
                "--target",
                missing_model,
                "--temperature",
                "0.7",
                "--llama-server",
                str(FAKE),
            ]
        )
        == 2
    )
    assert "greedy only" in capsys.readouterr().err
    assert main(["bench", "--prompts", str(prompts), "--methods", "llama-server-fast"]) == 2
    assert "unknown method" in capsys.readouterr().err


def _fake_binary(tmp_path) -> Path:
    exe = tmp_path / "llama-server"
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
    exe.chmod(0o755)
    return exe


@pytest.mark.process
def test_bench_llama_server_peers_through_a_stand_in_server(tmp_path, prompts, monkeypatch, capsys):
    """One server per peer for the whole run (its command line launch.servers' with one slot), each prompt's tokens
    as the stream carried them (equal to the llama.cpp peer's on the same file), TTFT and decode speed."""
    pytest.importorskip("llama_cpp", reason="the llama.cpp peers need llama-cpp-python (not installed)")
    from tinygguf import write_tiny_gguf

    target, draft = write_tiny_gguf(tmp_path / "target.gguf", 0), write_tiny_gguf(tmp_path / "draft.gguf", 1)
    record = tmp_path / "argv.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_SERVER_ARGV", str(record))
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench",
                "--prompts",
                str(prompts),
                "--threads",
                "1",
                "--max-new-tokens",
                "12",
                "--methods",
                "autoregressive,llama.cpp,llama-server,llama-server-draft,llama-server-ngram",
                "--target",
                str(target),
                "--draft",
                str(draft),
                "--backend",
                "llama.cpp",
                "--llama-server",
                str(_fake_binary(tmp_path)),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    capsys.readouterr()
    starts = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(starts) == 3  # one server per peer, for warm-up and both prompts
    flags = [" ".join(a) for a in starts]
    assert all("-np 1 -kvu" in f and "-t 1 -tb 1" in f for f in flags)
    assert "--spec-type" not in flags[0] and "--spec-type draft-simple -md" in flags[1]
    assert flags[2].endswith("--spec-type ngram-mod")
    results = json.loads((out / "results.json").read_text())
    rows = {(r["method"], r["prompt_id"]): r for r in results["prompts"]}
    for m in ("llama-server", "llama-server-draft", "llama-server-ngram"):
        for pid in ("1", "2"):
            r, ref = rows[(m, pid)], rows[("llama.cpp", pid)]
            assert r["token_ids"] == ref["token_ids"] and r["new_tokens"] == len(ref["token_ids"]) > 0, (m, pid)
            assert r["text"] == ref["text"] and 0 < r["ttft_s"] <= r["wall_s"]
        s = results["methods"][m]
        assert s["decode_tokens_per_second"] > 0 and s["vs_llama_cpp"]["overall"] > 0
        assert s["greedy_agreement"] == results["methods"]["llama.cpp"]["greedy_agreement"]
    assert set(results["config"]["server_peers"]) == {"llama-server", "llama-server-draft", "llama-server-ngram"}
    assert (out / "logs" / "llama-server-ngram.log").is_file()
    assert "| llama-server-ngram |" in (out / "report.md").read_text()


@pytest.mark.process
@pytest.mark.skipif(LLAMA_SERVER is None, reason="llama-server not built (specdecode loadtest --build-llama-server)")
def test_bench_real_llama_server_peers(tmp_path, prompts, capsys):
    """llama.cpp's own server, plain, with the draft and with n-gram speculation, on tiny GGUF files."""
    from tinygguf import write_tiny_gguf

    target, draft = write_tiny_gguf(tmp_path / "target.gguf", 0), write_tiny_gguf(tmp_path / "draft.gguf", 1)
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench",
                "--prompts",
                str(prompts),
                "--threads",
                "1",
                "--max-new-tokens",
                "12",
                "--methods",
                "autoregressive,llama-server,llama-server-draft,llama-server-ngram",
                "--target",
                str(target),
                "--draft",
                str(draft),
                "--backend",
                "llama.cpp",
                "--llama-server",
                str(LLAMA_SERVER),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    for m in ("llama-server", "llama-server-draft", "llama-server-ngram"):
        rows = [r for r in results["prompts"] if r["method"] == m]
        assert len(rows) == 2 and all(0 < r["ttft_s"] <= r["wall_s"] and r["new_tokens"] > 0 for r in rows), rows
        assert all(len(r["token_ids"]) <= r["new_tokens"] <= 12 for r in rows)
        assert results["methods"][m]["decode_tokens_per_second"] > 0
    assert not any(os.path.getsize(p) == 0 for p in (out / "logs").iterdir())
