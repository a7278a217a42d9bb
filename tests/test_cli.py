"""The CLI contract: flags, --json shape, exit status 2 with one line on stderr."""
import json
import subprocess
import sys

import pytest

from specdecode.cli import main


def cli(*args, input=None):
    return subprocess.run([sys.executable, "-m", "specdecode", *args], capture_output=True, text=True,
                          input=input, timeout=300)


def test_json_output_matches_python_api(tiny_dirs, capsys):
    target, draft = tiny_dirs
    code = main(["generate", "hello", "--target", str(target), "--draft", str(draft), "--method", "draft",
                 "--gamma", "3", "--max-new-tokens", "24", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "token_ids", "stats"}
    s = out["stats"]
    for key in ("new_tokens", "target_forwards", "drafted", "accepted", "acceptance_rate", "mean_accepted_tokens",
                "accepted_per_position", "wall_s", "tokens_per_second", "draft_s", "verify_s"):
        assert key in s
    assert s["new_tokens"] == len(out["token_ids"]) <= 24 and s["accepted"] <= s["drafted"]
    from specdecode import Engine
    engine = Engine.load(str(target), str(draft), progress=False)
    ref = engine.generate("hello", method="autoregressive", max_new_tokens=24)
    assert out["token_ids"] == ref.token_ids and out["text"] == ref.text


def test_tree_method_json_and_stats_line(tiny_dirs, capsys):
    target, draft = tiny_dirs
    code = main(["generate", "hello", "--target", str(target), "--draft", str(draft), "--method", "tree",
                 "--tree-width", "2", "--tree-depth", "3", "--tree-nodes", "5", "--max-new-tokens", "24", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    s = out["stats"]
    assert s["method"] == "tree" and s["tree"]["chosen_by_cost_model"] == []
    assert s["drafted"] <= 5 * s["target_forwards"] and s["expected_tokens_per_pass"] >= 1
    from specdecode import Engine
    ref = Engine.load(str(target), progress=False).generate("hello", method="autoregressive", max_new_tokens=24)
    assert out["token_ids"] == ref.token_ids  # greedy tree output is plain decoding's
    r = cli("generate", "abc", "--target", str(target), "--draft", str(draft), "--method", "tree",
            "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "[tree nodes/pass" in r.stderr and "expected tokens/pass" in r.stderr


def test_streamed_text_then_stats_line(tiny_dirs):
    target, _ = tiny_dirs
    r = cli("generate", "abc", "--target", str(target), "--method", "pld", "--max-new-tokens", "16",
            "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "1", "--dtype", "fp32")
    assert r.returncode == 0, r.stderr
    assert "[pld gamma=4] 16 tokens" in r.stderr and "finish: length" in r.stderr


def test_stdin_prompt_and_chat(tiny_dirs):
    target, _ = tiny_dirs
    r = cli("generate", "-", "--chat", "--target", str(target), "--method", "autoregressive",
            "--max-new-tokens", "4", "--json", input="hi there")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["prompt_tokens"] == len("<user>hi there\n<assistant>")


@pytest.mark.parametrize("args, match", [
    (["generate", "", "--method", "autoregressive"], "empty"),
    (["generate", "x", "--max-new-tokens", "0"], "max_new_tokens"),
    (["generate", "x", "--gamma", "0"], "gamma"),
    (["generate", "x", "--temperature", "-1"], "temperature"),
    (["generate", "x", "--top-p", "0"], "top_p"),
    (["generate", "x", "--top-p", "1.5"], "top_p"),
    (["generate", "x", "--method", "nope"], "invalid choice"),
    (["generate", "x", "--gamma", "two"], "invalid int"),
    (["generate", "x", "--method", "draft"], "draft model"),
    (["generate", "x", "--method", "tree", "--tree-width", "0"], "tree-width"),
    (["generate", "x", "--method", "pld", "--tree-depth", "2"], "method tree only"),
])
def test_bad_input_exit_2_one_line(tiny_dirs, args, match):
    target, _ = tiny_dirs
    r = cli(*args, "--target", str(target))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0], r.stderr


def test_missing_model_exit_2(tmp_path):
    r = cli("generate", "x", "--method", "pld", "--target", str(tmp_path / "nope"))
    assert r.returncode == 2 and "not found" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    (tmp_path / "empty").mkdir()
    r = cli("generate", "x", "--method", "pld", "--target", str(tmp_path / "empty"))
    assert r.returncode == 2 and "config.json" in r.stderr


def test_incompatible_draft_exit_2(tiny_dirs, tmp_path):
    from tiny import tiny_model
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models
    target, _ = tiny_dirs
    other = tmp_path / "other"
    tiny_model(3, vocab_size=3).save_pretrained(other)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, "[UNK]")),
                            unk_token="[UNK]").save_pretrained(other)
    r = cli("generate", "x", "--target", str(target), "--draft", str(other))
    assert r.returncode == 2 and "tokenizers differ" in r.stderr


def test_python_m_and_console_script_help():
    assert cli("--help").returncode == 0
    r = subprocess.run(["specdecode", "generate", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--max-new-tokens" in r.stdout
