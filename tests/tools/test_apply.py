"""`specdecode apply`: the code block taken from an answer, the diff, the file written in place with its backup, and
the whole command on the tiny models, locally and through a live server. A tiny random model writes no code block:
where a test needs one, the real generation runs and its text is replaced by a scripted answer."""

import os
import stat

import pytest

from specdecode.apply.cli import Reply, stats_line
from specdecode.apply.text import (
    NoCodeBlock,
    Source,
    answer_budget,
    build_request,
    extract_block,
    fence_for,
    match_final_newline,
    read_source,
    unified_diff,
    write_atomically,
)
from specdecode.cli import main
from specdecode.errors import SpecDecodeError

OLD = "def add(a, b):\n    return a + b\n"
NEW = "def plus(a, b):\n    return a + b\n"
INSTRUCTION = "Rename add to plus."


# -- the code block ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "answer",
    [
        f"```python\n{NEW}```",
        f"```\n{NEW}```\n",
        f"Here is the updated file:\n\n```py\n{NEW}```\n\nI renamed the function.",
        f"~~~python\n{NEW}~~~",
        # an indented fence: its indent goes
        f"  ```python\n  {NEW.replace(chr(10) + '    ', chr(10) + '      ')}  ```",
        f"```python\r\n{NEW.replace(chr(10), chr(13) + chr(10))}```\r\n",
        f"An example:\n```python\nplus(1, 2)\n```\nThe file:\n```python\n{NEW}```\n",  # the longest block is the file
    ],
    ids=["tagged", "untagged", "prose around", "tildes", "indented", "crlf", "two blocks"],
)
def test_the_code_block_is_the_new_file(answer):
    assert extract_block(answer) == NEW


def test_a_longer_fence_keeps_a_markdown_files_own_fences():
    readme = "# Use\n\n```bash\nmake\n```\n\nDone.\n"
    assert fence_for(readme) == "````" and fence_for(OLD) == "```"
    _, prediction = build_request(Source(_path("README.md"), readme), "x")
    assert prediction == f"````markdown\n{readme}````"
    assert extract_block(f"Sure.\n{prediction}\nAnything else?") == readme
    assert extract_block("```\nprint('```')\n```") == "print('```')\n"  # a fence line is backticks alone


@pytest.mark.parametrize(
    "answer, message",
    [
        (NEW, "no fenced code block"),
        ("", "no fenced code block"),
        ("Use ``plus`` instead of ``add``.", "no fenced code block"),
        (f"```python\n{NEW}", "stopped inside its code block"),
        (f"```python\n{NEW}~~~\n", "stopped inside its code block"),  # a closing fence of the other character
        (f"```\nx\n```\n```python\n{NEW}", "stopped inside its code block"),  # the file's block was cut off
    ],
)
def test_an_answer_without_a_complete_block_is_refused(answer, message):
    with pytest.raises(NoCodeBlock, match=message):
        extract_block(answer)


def test_the_final_newline_follows_the_file():
    assert match_final_newline("x = 1\n", "x = 0") == "x = 1"
    assert match_final_newline("x = 1\n", "x = 0\n") == "x = 1\n"
    assert match_final_newline("x = 1\n", "") == "x = 1\n"


def test_the_request_holds_file_and_instruction_and_predicts_the_file():
    messages, prediction = build_request(Source(_path("src/app.py"), OLD), "  " + INSTRUCTION + "\n")
    assert len(messages) == 1 and messages[0]["role"] == "user"
    prompt = messages[0]["content"]
    assert f"```python\n{OLD}```" in prompt and f"Instruction: {INSTRUCTION}\n" in prompt and "`app.py`" in prompt
    assert prompt.index(OLD) < prompt.index(INSTRUCTION)
    assert prediction == f"```python\n{OLD}```" and extract_block(prediction) == OLD
    _, prediction = build_request(Source(_path("notes"), "no newline"), "x")
    assert prediction == "```\nno newline\n```"  # no language tag for an unknown suffix; the block's line ended


# -- the diff ---------------------------------------------------------------------------------------------------------
def test_the_diff_is_gits():
    assert unified_diff(OLD, NEW, "app.py") == (
        "--- a/app.py\n+++ b/app.py\n@@ -1,2 +1,2 @@\n-def add(a, b):\n+def plus(a, b):\n     return a + b\n"
    )
    assert unified_diff(OLD, OLD, "app.py") == ""
    assert unified_diff("a\nb", "a\nc", "f") == (
        "--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n a\n-b\n\\ No newline at end of file\n+c\n\\ No newline at end of file\n"
    )


def test_the_diff_applies_with_patch(tmp_path):
    """`patch -p1` turns the old file into the new one, the last line's missing newline included."""
    import shutil
    import subprocess

    if shutil.which("patch") is None:
        pytest.skip("no patch command here")
    old = "".join(f"line {i}\n" for i in range(30)) + "end"
    new = old.replace("line 3\n", "").replace("line 20\n", "line 20\nadded\n").replace("end", "the end")
    (tmp_path / "f.txt").write_text(old)
    r = subprocess.run(
        ["patch", "-p1"], input=unified_diff(old, new, "f.txt"), cwd=tmp_path, text=True, capture_output=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "f.txt").read_text() == new


# -- reading and writing the file -------------------------------------------------------------------------------------
def test_unreadable_files_are_refused(tmp_path):
    with pytest.raises(SpecDecodeError, match="cannot read .*missing.py"):
        read_source(tmp_path / "missing.py")
    with pytest.raises(SpecDecodeError, match="cannot read"):
        read_source(tmp_path)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(SpecDecodeError, match=r"not UTF-8 text \(byte 0xe9 at offset 3\)"):
        read_source(tmp_path / "latin1.txt")
    (tmp_path / "blob").write_bytes(b"ab\x00cd")
    with pytest.raises(SpecDecodeError, match="binary"):
        read_source(tmp_path / "blob")


def test_written_in_place_with_a_backup_and_the_files_conventions(tmp_path):
    path = tmp_path / "app.py"
    path.write_bytes(b"\xef\xbb\xbfdef add(a, b):\r\n    return a + b\r\n")
    path.chmod(0o750)
    (tmp_path / "link.py").symlink_to(path)
    source = read_source(tmp_path / "link.py")
    assert source.text == OLD and source.crlf and source.bom
    backup = write_atomically(source, NEW)
    assert backup == path.with_name("app.py.orig")
    assert backup.read_bytes() == b"\xef\xbb\xbfdef add(a, b):\r\n    return a + b\r\n"
    assert path.read_bytes() == b"\xef\xbb\xbfdef plus(a, b):\r\n    return a + b\r\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o750 and (tmp_path / "link.py").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.py", "app.py.orig", "link.py"]  # no temporary left


def test_a_failed_write_leaves_the_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "app.py"
    path.write_text(OLD)

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_atomically(read_source(path), NEW)
    assert path.read_text() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.py", "app.py.orig"]


# -- the budget and the stats line ------------------------------------------------------------------------------------
def test_the_answers_budget_is_sized_from_the_file_within_the_context():
    assert answer_budget(100, 300, 4096) == 100 * 3 // 2 + 64
    assert answer_budget(100, 300, 400) == 100  # the room the context leaves
    with pytest.raises(SpecDecodeError, match="has 500 tokens; the model's context holds 400"):
        answer_budget(100, 500, 400)


def test_the_stats_line_sets_the_speed_beside_plain_decodings():
    stats = {"new_tokens": 120, "wall_s": 3.0, "ttft_s": 1.0, "decode_tokens_per_second": 40.0}
    reply = Reply("a", "stop", stats, accepted=100, rejected=4)
    line = stats_line(reply, Reply("a", "stop", {"decode_tokens_per_second": 10.0}), "backend torch")
    assert line == (
        "apply: 120 tokens in 3.00s (first after 1.00s), decode 40.00 tok/s | prediction: 100 tokens "
        "accepted, 4 rejected | plain decoding 10.00 tok/s (measured, same answer): 4.00x | backend torch"
    )
    assert "its answer differs" in stats_line(reply, Reply("b", "stop", {}), "")
    assert "plain decoding ~20.00 tok/s (the cost model's): ~2.00x" in stats_line(
        Reply("a", "stop", {**stats, "plain_step_s": 0.05}), None, ""
    )
    assert "plain decoding: --compare measures it" in stats_line(reply, None, "")


def test_the_prediction_counts_are_the_usage_fields_where_the_stats_hold_them():
    from types import SimpleNamespace

    from specdecode.apply.cli import reply_of_generation

    class Stats(SimpleNamespace):
        def as_dict(self):
            return dict(vars(self))

    drafted = Stats(finish_reason="eos", sources={"prediction": {"drafted": 50, "accepted": 40}})
    assert (
        reply_of_generation(SimpleNamespace(text="x", stats=drafted)).accepted,
        reply_of_generation(SimpleNamespace(text="x", stats=drafted)).rejected,
    ) == (40, 10)
    usage = Stats(**vars(drafted), accepted_prediction_tokens=45, rejected_prediction_tokens=3)
    reply = reply_of_generation(SimpleNamespace(text="x", stats=usage))
    assert (reply.text, reply.finish, reply.accepted, reply.rejected) == ("x", "eos", 45, 3)


def test_a_server_answer_of_another_shape_is_a_clear_error():
    from specdecode.apply.cli import reply_of
    from specdecode.apply.client import base_url, first_model

    with pytest.raises(SpecDecodeError, match="not a chat completion"):
        reply_of({"error": "x"})
    with pytest.raises(SpecDecodeError, match="lists no model; name one with --model"):
        first_model({"data": []}, "http://h")
    reply = reply_of(
        {
            "choices": [{"message": {"content": "a"}, "finish_reason": "length"}],
            "usage": {"completion_tokens_details": {"accepted_prediction_tokens": 7, "rejected_prediction_tokens": 2}},
        }
    )
    assert (reply.text, reply.finish, reply.stats, reply.accepted, reply.rejected) == ("a", "length", {}, 7, 2)
    assert base_url("127.0.0.1:8000/v1/") == "http://127.0.0.1:8000" == base_url("http://127.0.0.1:8000")


def _path(name):
    from pathlib import Path

    return Path(name)


# -- the command, on the tiny models ----------------------------------------------------------------------------------
@pytest.fixture
def app_file(tmp_path):
    path = tmp_path / "app.py"
    path.write_text(OLD)
    return path


def run_apply(capsys, *args):
    capsys.readouterr()
    try:
        code = main(["apply", *map(str, args)])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def scripted(monkeypatch):
    """Engine.generate runs for real, then its text is replaced by a scripted answer: the edited file in a block.
    Returns the keyword arguments of each call (with the prompt as `prompt`)."""
    from specdecode.engine import Engine

    calls, real = [], Engine.generate

    def generate(self, prompt, **kwargs):
        calls.append({"prompt": prompt, **kwargs})
        out = real(self, prompt, **kwargs)
        out.text = f"Here it is:\n\n```python\n{NEW}```\n"
        return out

    monkeypatch.setattr(Engine, "generate", generate)
    return calls


def test_apply_prints_the_diff_of_the_answers_block(tiny_dirs, app_file, capsys, scripted, monkeypatch):
    import io

    target, _ = tiny_dirs
    monkeypatch.setattr("sys.stdin", io.StringIO(INSTRUCTION))  # INSTRUCTION "-": read from stdin
    code, out, err = run_apply(capsys, app_file, "-", "--target", target, "--method", "pld")
    assert code == 0, err
    assert out == unified_diff(OLD, NEW, app_file.as_posix().lstrip("/"))
    assert app_file.read_text() == OLD and not app_file.with_name("app.py.orig").exists()
    (call,) = scripted
    prompt = call["prompt"][0]["content"]
    assert OLD in prompt and INSTRUCTION in prompt
    assert call["prediction"] == f"```python\n{OLD}```" and call["method"] == "pld"
    # the byte tokenizer: a token per byte, so the answer's budget is the prediction's bytes x 1.5 + the margin
    assert call["max_new_tokens"] == len(call["prediction"]) * 3 // 2 + 64
    assert err.startswith("apply: ") and "| prediction: " in err and "| backend torch" in err


def test_apply_writes_the_file_and_compares_with_plain_decoding(tiny_dirs, app_file, capsys, scripted):
    target, _ = tiny_dirs
    code, out, err = run_apply(
        capsys,
        app_file,
        INSTRUCTION,
        "--target",
        target,
        "--method",
        "pld",
        "--write",
        "--compare",
        "--max-new-tokens",
        "12",
    )
    assert code == 0, err
    assert out == "" and app_file.read_text() == NEW and app_file.with_name("app.py.orig").read_text() == OLD
    assert [c["method"] for c in scripted] == ["pld", "autoregressive"]
    assert [c["max_new_tokens"] for c in scripted] == [12, 12] and "prediction" not in scripted[1]
    assert "plain decoding " in err and "(measured, same answer)" in err and f"wrote {app_file}" in err
    # the same edit again: the answer leaves the file as it is, nothing written, no diff
    app_file.with_name("app.py.orig").unlink()
    code, out, err = run_apply(
        capsys, app_file, INSTRUCTION, "--target", target, "--method", "pld", "--write", "--max-new-tokens", "4"
    )
    assert code == 0 and out == "" and "leaves" in err and not app_file.with_name("app.py.orig").exists()


def test_a_real_answer_without_a_block_leaves_the_file_alone(tiny_dirs, app_file, capsys):
    target, _ = tiny_dirs
    code, out, err = run_apply(
        capsys, app_file, INSTRUCTION, "--target", target, "--method", "pld", "--write", "--max-new-tokens", "24"
    )
    assert code == 1 and out == ""
    assert "apply: 24 tokens" in err and "no fenced code block" in err and "token limit" in err
    assert app_file.read_text() == OLD and not app_file.with_name("app.py.orig").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["missing.py", INSTRUCTION], "cannot read"),
        (["blob", INSTRUCTION], "binary"),
        (["app.py", " "], "the instruction is empty"),
        (["app.py", INSTRUCTION, "--max-new-tokens", "0"], "max_new_tokens"),
        (["app.py", INSTRUCTION, "--server", "http://127.0.0.1:9", "--target", "x"], "--target"),
        (["app.py", INSTRUCTION, "--server", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9/v1/models"),
    ],
)
def test_bad_input_exits_2_with_one_line_before_any_model_loads(args, message, tmp_path, capsys, monkeypatch):
    (tmp_path / "app.py").write_text(OLD)
    (tmp_path / "blob").write_bytes(b"\x00\x01")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_apply(capsys, *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("specdecode: error:") and message in err, err


# -- through a live server --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(tiny_engine):
    from helpers import LiveServer
    from specdecode.server import create_app

    srv = LiveServer(create_app(tiny_engine, model_id="tiny", method="pld", gamma=3))
    yield srv
    srv.stop()


def test_apply_through_the_server_sends_the_file_as_the_prediction(live, app_file, capsys, monkeypatch):
    """The request reaches the server's engine with the file in the prompt and as the prediction; the tiny model's
    answer has no code block, so the command says so (exit 1) and the file stays as it was."""
    from specdecode.engine import Engine

    seen, real = [], Engine.open

    def open_(self, request):  # what the server opens: the typed request (or it encoded)
        seen.append(getattr(request, "request", request))
        return real(self, request)

    monkeypatch.setattr(Engine, "open", open_)
    code, out, err = run_apply(
        capsys,
        app_file,
        INSTRUCTION,
        "--server",
        live.url + "/v1/",
        "--method",
        "pld",
        "--max-new-tokens",
        "16",
        "--write",
        "--compare",
    )
    assert code == 1 and out == "" and app_file.read_text() == OLD, err
    assert f"| server {live.url} (model tiny)" in err and "apply: 16 tokens" in err and "(measured" in err
    assert "no fenced code block" in err
    first, plain = seen
    assert OLD in first.prompt[0]["content"] and INSTRUCTION in first.prompt[0]["content"]
    assert first.prediction == f"```python\n{OLD}```" and first.method == "pld" and first.max_new_tokens == 16
    assert plain.method == "autoregressive" and plain.prediction is None
