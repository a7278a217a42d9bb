"""The CLI contract: flags, --json shape, exit status 2 with one line on stderr."""

import json
import sys
from pathlib import Path

import pytest

from helpers import run_child as run  # the child-process runner (helpers.run drives the loop)
from specdecode.cli import main
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams


def cli(*args, input=None):
    return run([sys.executable, "-m", "specdecode", *args], input=input)


def main_here(capsys, *args, monkeypatch=None, input=None):
    """(exit status, stdout, stderr) of the command run by main() in this process: what the console script runs,
    without a child process's seconds of imports (a child's exit status: the tests marked `process`)."""
    if input is not None:
        import io

        monkeypatch.setattr(sys, "stdin", io.StringIO(input))
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's errors leave through _Parser.error
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_matches_python_api(tiny_dirs, capsys):
    target, draft = tiny_dirs
    code = main(
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
            "24",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "token_ids", "stats"}
    s = out["stats"]
    for key in (
        "new_tokens",
        "target_forwards",
        "drafted",
        "accepted",
        "acceptance_rate",
        "mean_accepted_tokens",
        "accepted_per_position",
        "wall_s",
        "tokens_per_second",
        "draft_s",
        "verify_s",
    ):
        assert key in s
    assert s["new_tokens"] == len(out["token_ids"]) <= 24 and s["accepted"] <= s["drafted"]
    from specdecode import Engine

    engine = Engine.load(str(target), str(draft), progress=False)
    ref = engine.generate("hello", method="autoregressive", max_new_tokens=24)
    assert out["token_ids"] == ref.token_ids and out["text"] == ref.text


def test_tree_method_json_and_stats_line(tiny_dirs, capsys):
    target, draft = tiny_dirs
    code = main(
        [
            "generate",
            "hello",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--method",
            "tree",
            "--tree-width",
            "2",
            "--tree-depth",
            "3",
            "--tree-nodes",
            "5",
            "--max-new-tokens",
            "24",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    s = out["stats"]
    assert s["method"] == "tree" and s["tree"]["chosen_by_cost_model"] == []
    assert s["drafted"] <= 5 * s["target_forwards"] and s["expected_tokens_per_pass"] >= 1
    from specdecode import Engine

    ref = Engine.load(str(target), progress=False).generate("hello", method="autoregressive", max_new_tokens=24)
    assert out["token_ids"] == ref.token_ids  # greedy tree output is plain decoding's
    code, _, err = main_here(
        capsys,
        "generate",
        "abc",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--method",
        "tree",
        "--max-new-tokens",
        "12",
    )
    assert code == 0, err
    assert "[tree nodes/pass" in err and "expected tokens/pass" in err


def test_streamed_text_then_stats_line(tiny_dirs, capsys):
    target, _ = tiny_dirs
    code, out, err = main_here(
        capsys,
        "generate",
        "abc",
        "--target",
        str(target),
        "--method",
        "pld",
        "--max-new-tokens",
        "16",
        "--temperature",
        "0.8",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--seed",
        "1",
        "--dtype",
        "fp32",
    )
    assert code == 0, err
    assert "[pld gamma=4] 16 tokens" in err and "finish: length" in err and out


def test_stdin_prompt_and_chat(tiny_dirs, capsys, monkeypatch):
    target, _ = tiny_dirs
    code, out, err = main_here(
        capsys,
        "generate",
        "-",
        "--chat",
        "--target",
        str(target),
        "--method",
        "autoregressive",
        "--max-new-tokens",
        "4",
        "--json",
        monkeypatch=monkeypatch,
        input="hi there",
    )
    assert code == 0, err
    assert json.loads(out)["stats"]["prompt_tokens"] == len("<user>hi there\n<assistant>")


# The Engine is the one validation layer: the CLI prints its message (one line, exit 2). `engine` says how
# the Engine itself rejects the same input; None: argparse rejects it.
BAD_INPUT = [
    (["generate", "", "--method", "autoregressive"], lambda e: e.stream("", method="autoregressive")),
    (["generate", "x", "--max-new-tokens", "0"], lambda e: e.stream("x", max_new_tokens=0)),
    (["generate", "x", "--gamma", "0", "--method", "pld"], lambda e: e.stream("x", method="pld", gamma=0)),
    (["generate", "x", "--gamma", "0"], lambda e: e.stream("x", method="pld", gamma=0)),  # auto does not use gamma
    (["generate", "x", "--temperature", "-1"], lambda e: SamplingParams(-1.0)),
    (["generate", "x", "--top-p", "0"], lambda e: SamplingParams(top_p=0.0)),
    (["generate", "x", "--top-p", "1.5"], lambda e: SamplingParams(top_p=1.5)),
    (["generate", "x", "--method", "draft"], lambda e: e.stream("x", method="draft")),
    (["generate", "x", "--method", "tree", "--tree-width", "0"], lambda e: e.stream("x", method="tree", tree_width=0)),
    (["generate", "x", "--method", "pld", "--tree-depth", "2"], lambda e: e.stream("x", method="pld", tree_depth=2)),
    (["generate", "x", "--method", "nope"], "invalid choice"),
    (["generate", "x", "--gamma", "two"], "invalid int"),
]


@pytest.mark.parametrize("args, engine", BAD_INPUT, ids=[" ".join(a[2:]) or "empty" for a, _ in BAD_INPUT])
def test_bad_input_exit_2_with_the_engines_message(tiny_dirs, args, engine, capsys):
    target, _ = tiny_dirs
    code, _, err = main_here(capsys, *args, "--target", str(target))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    if isinstance(engine, str):
        assert engine in lines[0]
        return
    from specdecode import Engine

    with pytest.raises(SpecDecodeError) as e:
        engine(Engine.load(str(target), progress=False))
    assert lines[0] == f"specdecode: error: {e.value}"


@pytest.mark.process
def test_serve_and_bench_without_their_extras(tiny_dirs):
    """`import specdecode` and `specdecode generate` need neither the server nor the bench packages; serve and
    bench name the extra to install."""
    target, _ = tiny_dirs
    code = f"""
import sys
for name in ("fastapi", "starlette", "uvicorn", "prometheus_client", "pydantic", "anyio", "matplotlib"):
    sys.modules[name] = None  # as if not installed: importing it fails
from specdecode.cli import main
assert main(["generate", "abc", "--target", {str(target)!r}, "--method", "pld", "--max-new-tokens", "4"]) == 0
print()
assert main(["serve", "--target", {str(target)!r}]) == 2
assert main(["bench", "--prompts", "p.jsonl"]) == 2
"""
    r = run([sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("specdecode: error:")]
    assert len(errors) == 2
    assert 'pip install "specdecode[server]"' in errors[0] and "fastapi" in errors[0]
    assert 'pip install "specdecode[bench]"' in errors[1] and "matplotlib" in errors[1]


def test_missing_model_exit_2(tmp_path, capsys):
    code, _, err = main_here(capsys, "generate", "x", "--method", "pld", "--target", str(tmp_path / "nope"))
    assert code == 2 and "not found" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "empty").mkdir()
    code, _, err = main_here(capsys, "generate", "x", "--method", "pld", "--target", str(tmp_path / "empty"))
    assert code == 2 and "config.json" in err


def test_incompatible_draft_exit_2(tiny_dirs, tmp_path, capsys):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from tiny import tiny_model

    target, _ = tiny_dirs
    other = tmp_path / "other"
    tiny_model(3, vocab_size=3).save_pretrained(other)
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, "[UNK]")), unk_token="[UNK]"
    ).save_pretrained(other)
    code, _, err = main_here(capsys, "generate", "x", "--target", str(target), "--draft", str(other))
    assert code == 2 and "tokenizers differ" in err


@pytest.mark.process
def test_python_m_and_console_script_help():
    """The command in a child process: help, and a usage error's exit status 2 with one line (no parser loads torch:
    a third of a second each)."""
    assert cli("--help").returncode == 0
    r = cli("generate", "x", "--gamma", "two")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "invalid int" in r.stderr, r.stderr
    # the console script installed beside this interpreter, whether or not its bin/ is on PATH
    script = Path(sys.executable).parent / "specdecode"
    r = run([str(script), "generate", "--help"], timeout=120)
    assert r.returncode == 0 and "--max-new-tokens" in r.stdout
