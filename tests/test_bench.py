"""The benchmark harness end to end on tiny models, plus its arithmetic on known numbers."""
import json

import pytest

from specdecode.bench import (alpha_from_counts, analytic_bound, cost_model_bound, load_prompts, parse_methods, run_bench, summarize,
                              write_outputs)
from specdecode.cli import main
from specdecode.errors import SpecDecodeError


@pytest.fixture
def prompt_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "def add(a, b):", "category": "code"}\n\n'
                 '{"turns": ["Say hi.", "again"], "category": "chat"}\n'
                 '{"prompt": "abcabcabc", "category": "code"}\n')
    return f


def test_bound_formula_on_known_values():
    # Leviathan et al. 2023, Thm 3.8: (1 - a^(g+1)) / ((1 - a)(g c + 1))
    assert analytic_bound(0.8, 4, 0.05) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.2))
    assert analytic_bound(0.0, 3, 0.0) == pytest.approx(1.0)
    assert analytic_bound(1.0, 4, 0.25) == pytest.approx(5 / 2)
    assert analytic_bound(0.5, 1, 1.0) == pytest.approx(1.5 / 2)
    assert alpha_from_counts(8, 2) == pytest.approx(0.8) and alpha_from_counts(0, 0) is None
    # with a verify pass costing v = 1 it is the theorem; a dearer pass lowers the ceiling
    assert cost_model_bound(0.8, 4, 0.05, 1.0) == pytest.approx(analytic_bound(0.8, 4, 0.05))
    assert cost_model_bound(0.8, 2, 0.3, 2.0) == pytest.approx((1 + 0.8 + 0.64) / (0.6 + 2.0))


def _row(pid, method, tokens, wall, **kw):
    base = dict(prompt_id=pid, category=None, method=method, token_ids=list(range(tokens)), new_tokens=tokens,
                wall_s=wall, tokens_per_second=tokens / wall, target_forwards=None, drafted=None, accepted=None,
                rejections=None, mean_accepted_tokens=None, acceptance_rate=None, accepted_per_position=None,
                drafted_per_position=None, draft_s=None, verify_s=None)
    base.update(kw)
    return base


def test_speedup_arithmetic_on_known_timings():
    rows = [
        _row("a", "autoregressive", 100, 10.0, target_forwards=100, verify_s=10.0, draft_s=0.0),
        _row("b", "autoregressive", 100, 30.0, target_forwards=100, verify_s=30.0, draft_s=0.0),
        # draft: 200 tokens in 20 s -> 10 tok/s vs 200/40 = 5 tok/s -> 2.0x
        _row("a", "draft", 100, 5.0, target_forwards=40, drafted=120, accepted=60, rejections=30, verify_s=4.0,
             draft_s=1.2, accepted_per_position=[30, 20, 10], drafted_per_position=[40, 40, 40]),
        _row("b", "draft", 100, 15.0, target_forwards=40, drafted=120, accepted=60, rejections=30, verify_s=12.0,
             draft_s=3.6, accepted_per_position=[30, 20, 10], drafted_per_position=[40, 40, 40]),
    ]
    res = summarize(rows, ["autoregressive", "draft"], gamma=3, greedy=True, config={})["methods"]
    assert res["autoregressive"]["tokens_per_second"] == pytest.approx(5.0)
    d = res["draft"]
    assert d["tokens_per_second"] == pytest.approx(10.0) and d["speedup"] == pytest.approx(2.0)
    assert d["mean_accepted_tokens"] == pytest.approx(200 / 80)
    assert d["acceptance_rate"] == pytest.approx(0.5)
    assert d["alpha"] == pytest.approx(120 / 180)
    ar_step = 40.0 / 200  # seconds per plain target forward
    assert d["draft_cost_ratio"] == pytest.approx(4.8 / 240 / ar_step)
    assert d["verify_cost_ratio"] == pytest.approx(16.0 / 80 / ar_step)
    bound = analytic_bound(120 / 180, 3, 4.8 / 240 / ar_step)
    assert d["analytic_bound"] == pytest.approx(bound) and d["efficiency"] == pytest.approx(2.0 / bound)
    assert d["cost_model_bound"] == pytest.approx(
        cost_model_bound(120 / 180, 3, 4.8 / 240 / ar_step, 16.0 / 80 / ar_step))
    assert d["acceptance_by_position"] == pytest.approx([0.75, 0.5, 0.25])
    assert d["greedy_agreement"] == 1.0


def test_bench_end_to_end_on_tiny_models(tiny_dirs, prompt_file, tmp_path, capsys):
    target, draft = tiny_dirs
    out = tmp_path / "out"
    code = main(["bench", "--prompts", str(prompt_file), "--methods", "draft,pld,hf-assisted", "--gamma", "3",
                 "--max-new-tokens", "16", "--target", str(target), "--draft", str(draft), "--out", str(out)])
    assert code == 0
    assert "speedup" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"config", "methods", "prompts"}
    assert list(results["methods"]) == ["autoregressive", "draft", "pld", "hf-assisted"]
    for name, m in results["methods"].items():
        for key in ("tokens_per_second", "speedup", "mean_accepted_tokens", "acceptance_rate", "analytic_bound",
                    "efficiency", "greedy_agreement"):
            assert key in m
        assert m["tokens_per_second"] > 0
        assert set(m["by_category"]) == {"chat", "code"}
    assert results["methods"]["autoregressive"]["speedup"] == 1.0
    assert results["methods"]["draft"]["greedy_agreement"] == 1.0  # lossless greedy
    assert results["methods"]["pld"]["greedy_agreement"] == 1.0
    assert results["methods"]["hf-assisted"]["mean_accepted_tokens"] is None
    assert results["methods"]["draft"]["analytic_bound"] > 0
    assert len(results["prompts"]) == 3 * 4
    assert [r["method"] for r in results["prompts"][:4]] == ["autoregressive", "draft", "pld", "hf-assisted"]
    report = (out / "report.md").read_text()
    assert "| draft |" in report and "Speedup by category" in report
    for png in ("speedup.png", "acceptance.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_bench_tree_method(tiny_dirs, prompt_file, tmp_path, capsys):
    target, draft = tiny_dirs
    out = tmp_path / "out"
    code = main(["bench", "--prompts", str(prompt_file), "--methods", "draft,tree", "--gamma", "3",
                 "--tree-width", "2", "--max-new-tokens", "12", "--target", str(target), "--draft", str(draft),
                 "--out", str(out)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    tree = results["methods"]["tree"]
    assert tree["greedy_agreement"] == 1.0 and tree["nodes_per_pass"] > 0
    assert tree["expected_tokens_per_pass"] >= 1 and tree["depth_per_pass"] > 0
    assert tree["analytic_bound"] is None  # the chain bound does not apply to trees
    assert results["config"]["tree"] == {"tree_width": 2} and results["config"]["pass_costs"]["target"]
    assert "## Token tree" in (out / "report.md").read_text()
    assert main(["bench", "--prompts", str(prompt_file), "--methods", "draft", "--tree-depth", "2",
                 "--target", str(target), "--draft", str(draft)]) == 2


def test_prompt_file_errors(tmp_path):
    with pytest.raises(SpecDecodeError, match="not found"):
        load_prompts(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    with pytest.raises(SpecDecodeError, match=r"bad.jsonl:2"):
        load_prompts(bad)
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    with pytest.raises(SpecDecodeError, match=r":2: needs"):
        load_prompts(bad)
    bad.write_text("\n")
    with pytest.raises(SpecDecodeError, match="no prompts"):
        load_prompts(bad)


def test_prompt_file_fields(prompt_file):
    rows = load_prompts(prompt_file)
    assert [r["chat"] for r in rows] == [False, True, False]
    assert rows[1]["prompt"] == "Say hi." and rows[1]["category"] == "chat"
    assert len(load_prompts(prompt_file, limit=2)) == 2


def test_unknown_method():
    with pytest.raises(SpecDecodeError, match="unknown method"):
        parse_methods("draft,tree-of-thought")
    assert parse_methods("pld") == ["autoregressive", "pld"]


def test_cli_bench_bad_input_exit_2(tmp_path, capsys):
    assert main(["bench", "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "x"}\n')
    assert main(["bench", "--prompts", str(f), "--methods", "warp"]) == 2
    assert main(["bench", "--prompts", str(f), "--gamma", "0"]) == 2


def test_shared_datasets_parse():
    from pathlib import Path
    data = Path(__file__).resolve().parents[2] / "shared" / "data"
    if not data.is_dir():
        pytest.skip("../shared/data is not beside this checkout")
    he = load_prompts(data / "humaneval.jsonl")
    mt = load_prompts(data / "mt_bench.jsonl")
    assert len(he) == 164 and not he[0]["chat"]
    assert len(mt) == 80 and mt[0]["chat"] and mt[0]["category"] == "writing"
