"""The benchmark harness end to end on tiny models, plus its arithmetic on known numbers."""

import importlib
import json

import pytest

from specdecode.bench import (
    alpha_from_counts,
    analytic_bound,
    cost_model_bound,
    load_prompts,
    parse_methods,
    report,
    summarize,
)
from specdecode.cli import main
from specdecode.errors import SpecDecodeError


@pytest.fixture
def prompt_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"prompt": "def add(a, b):", "category": "code"}\n\n'
        '{"turns": ["Say hi.", "again"], "category": "chat"}\n'
        '{"prompt": "abcabcabc", "category": "code"}\n'
    )
    return f


def test_bound_formula_on_known_values():
    # Leviathan et al. 2023, Thm 3.8: (1 - a^(g+1)) / ((1 - a)(g c + 1))
    assert analytic_bound(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / (0.2 * 1.2))
    assert analytic_bound(0.0, 3, 0.0) == pytest.approx(1.0)
    assert analytic_bound(1.0, 4, 0.25) == pytest.approx(5 / 2)
    assert analytic_bound(0.5, 1, 1.0) == pytest.approx(1.5 / 2)
    assert alpha_from_counts(8, 2) == pytest.approx(0.8) and alpha_from_counts(0, 0) is None
    # with a verify pass costing v = 1 it is the theorem; a dearer pass lowers the ceiling
    assert cost_model_bound(0.8, 4, 0.05, 1.0) == pytest.approx(analytic_bound(0.8, 4, 0.05))
    assert cost_model_bound(0.8, 2, 0.3, 2.0) == pytest.approx((1 + 0.8 + 0.64) / (0.6 + 2.0))


def _row(pid, method, tokens, wall, **kw):
    base = dict(
        prompt_id=pid,
        category=None,
        method=method,
        token_ids=list(range(tokens)),
        new_tokens=tokens,
        wall_s=wall,
        tokens_per_second=tokens / wall,
        target_forwards=None,
        drafted=None,
        accepted=None,
        rejections=None,
        mean_accepted_tokens=None,
        acceptance_rate=None,
        accepted_per_position=None,
        drafted_per_position=None,
        draft_s=None,
        verify_s=None,
    )
    base.update(kw)
    return base


def test_speedup_arithmetic_on_known_timings():
    rows = [
        _row("a", "autoregressive", 100, 10.0, target_forwards=100, verify_s=10.0, draft_s=0.0),
        _row("b", "autoregressive", 100, 30.0, target_forwards=100, verify_s=30.0, draft_s=0.0),
        # draft: 200 tokens in 20 s -> 10 tok/s vs 200/40 = 5 tok/s -> 2.0x
        _row(
            "a",
            "draft",
            100,
            5.0,
            target_forwards=40,
            drafted=120,
            accepted=60,
            rejections=30,
            verify_s=4.0,
            draft_s=1.2,
            accepted_per_position=[30, 20, 10],
            drafted_per_position=[40, 40, 40],
        ),
        _row(
            "b",
            "draft",
            100,
            15.0,
            target_forwards=40,
            drafted=120,
            accepted=60,
            rejections=30,
            verify_s=12.0,
            draft_s=3.6,
            accepted_per_position=[30, 20, 10],
            drafted_per_position=[40, 40, 40],
        ),
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
        cost_model_bound(120 / 180, 3, 4.8 / 240 / ar_step, 16.0 / 80 / ar_step)
    )
    assert d["acceptance_by_position"] == pytest.approx([0.75, 0.5, 0.25])
    assert d["greedy_agreement"] == 1.0


def test_prefill_and_decode_arithmetic_on_known_timings():
    """TTFT, decode tok/s (tokens after the first / seconds after the first), their speedups, the ratios
    against the llama.cpp peer, overall and per category, and auto's predicted speedup per category."""
    rows = [
        _row("a", "autoregressive", 11, 2.0, category="x", ttft_s=1.0),
        _row("b", "autoregressive", 21, 4.0, category="y", ttft_s=2.0),
        # auto: a's runs in its own plain step (0.1 s), b's fall back on the measured 1-token pass (0.25 s)
        _row(
            "a",
            "auto",
            11,
            1.5,
            category="x",
            ttft_s=1.0,
            target_forwards=5,
            tree_depth=0,
            expected_tokens=6.0,
            planned_passes=3,
            modelled_s=0.3,
            plain_step_s=0.1,
            strategies={"plain": 2, "lookup": 3},
        ),
        _row(
            "b",
            "auto",
            21,
            3.0,
            category="y",
            ttft_s=2.0,
            target_forwards=10,
            tree_depth=0,
            expected_tokens=12.0,
            planned_passes=6,
            modelled_s=0.5,
            plain_step_s=None,
            strategies={"draft": 10},
        ),
        _row("a", "llama.cpp", 11, 1.0, category="x", ttft_s=0.5),
        _row("b", "llama.cpp", 21, 2.0, category="y", ttft_s=1.0),
        _row("a", "hf-assisted", 11, 1.0, category="x", ttft_s=None),
        _row("b", "hf-assisted", 21, 2.0, category="y", ttft_s=None),
    ]
    methods = ["autoregressive", "auto", "llama.cpp", "hf-assisted"]
    res = summarize(rows, methods, gamma=4, greedy=True, config={"pass_costs": {"target_s_1": 0.25}})["methods"]
    ar, auto, peer, hf = (res[m] for m in methods)
    assert ar["ttft_s"] == pytest.approx(1.5) and auto["ttft_s"] == pytest.approx(1.5)
    assert ar["decode_tokens_per_second"] == pytest.approx(30 / 3.0) and ar["decode_speedup"] == pytest.approx(1.0)
    assert auto["decode_tokens_per_second"] == pytest.approx(30 / 1.5) and auto["decode_speedup"] == pytest.approx(2.0)
    assert auto["speedup"] == pytest.approx(6.0 / 4.5)
    assert auto["vs_llama_cpp"] == pytest.approx({"overall": 3.0 / 4.5, "decode": 1.0})
    assert peer["vs_llama_cpp"] == pytest.approx({"overall": 1.0, "decode": 1.0})
    assert ar["vs_llama_cpp"] == pytest.approx({"overall": 0.5, "decode": 0.5})
    # no first-token time: no TTFT, no decode speed, but the overall speed and its ratios
    assert hf["ttft_s"] is None and hf["decode_tokens_per_second"] is None and hf["decode_speedup"] is None
    assert hf["vs_llama_cpp"]["decode"] is None and hf["vs_llama_cpp"]["overall"] == pytest.approx(1.0)
    # predicted: expected tokens / modelled seconds counted in plain steps (0.3/0.1 + 0.5/0.25 = 5 steps)
    assert auto["predicted_speedup"] == pytest.approx(18 / 5)
    x, y = auto["by_category"]["x"], auto["by_category"]["y"]
    assert x["tokens_per_second"] == pytest.approx(11 / 1.5) and x["speedup"] == pytest.approx(2.0 / 1.5)
    assert x["decode_tokens_per_second"] == pytest.approx(20.0) and x["decode_speedup"] == pytest.approx(2.0)
    assert x["ttft_s"] == pytest.approx(1.0) and y["ttft_s"] == pytest.approx(2.0)
    assert x["vs_llama_cpp"] == pytest.approx({"overall": 1.0 / 1.5, "decode": 1.0})
    assert x["predicted_speedup"] == pytest.approx(2.0) and y["predicted_speedup"] == pytest.approx(6.0)
    assert x["mean_accepted_tokens"] == pytest.approx(11 / 5) and x["expected_tokens_per_pass"] == pytest.approx(2.0)
    assert x["strategies"] == {"plain": 2, "lookup": 3} and y["strategies"] == {"draft": 10}
    assert res["hf-assisted"]["by_category"]["x"]["decode_tokens_per_second"] is None
    assert "mean_accepted_tokens" not in res["llama.cpp"]["by_category"]["x"]  # a peer has no target passes of ours
    text = report(
        {
            "config": {
                "prompts": 2,
                "max_new_tokens": 20,
                "gamma": 4,
                "temperature": 0.0,
                "device": "cpu",
                "dtype": "F32",
                "torch_threads": 1,
            },
            "methods": res,
            "prompts": [{**r, "mean_accepted_tokens": None} for r in rows],
        }
    )
    assert "## Prefill and decoding" in text and "### Prefill and decoding by category" in text
    assert "| auto | 1.500 | 20.00 | 7.11 | 2.00x | 1.33x | 0.67x | 1.00x |" in text
    assert "| x | auto | 1.000 | 20.00 | 7.33 | 2.00x | 1.33x | 0.67x | 1.00x |" in text
    assert "### auto by category: predicted against realised" in text
    assert "| x | plain 2, lookup 3 | 2.00 | 2.20 | 2.00x | 2.00x | 1.33x | 100% |" in text
    assert "| hf-assisted | – | – | 10.67 |" in text
    # without the llama.cpp peer there is nothing to compare with
    res = summarize(rows[:4], methods[:2], gamma=4, greedy=True, config={})["methods"]
    assert res["auto"]["vs_llama_cpp"] is None and res["auto"]["by_category"]["x"]["vs_llama_cpp"] is None
    assert res["auto"]["predicted_speedup"] == pytest.approx(6 / 3)  # only the run with its own plain step


def test_bench_end_to_end_on_tiny_models(tiny_dirs, prompt_file, tmp_path, capsys):
    target, draft = tiny_dirs
    out = tmp_path / "out"
    code = main(
        [
            "bench",
            "--prompts",
            str(prompt_file),
            "--methods",
            "draft,pld,hf-assisted",
            "--gamma",
            "3",
            "--max-new-tokens",
            "16",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    assert "speedup" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"config", "methods", "prompts"}
    assert list(results["methods"]) == ["autoregressive", "draft", "pld", "hf-assisted"]
    for name, m in results["methods"].items():
        for key in (
            "tokens_per_second",
            "speedup",
            "mean_accepted_tokens",
            "acceptance_rate",
            "analytic_bound",
            "efficiency",
            "greedy_agreement",
        ):
            assert key in m
        assert m["tokens_per_second"] > 0
        assert set(m["by_category"]) == {"chat", "code"}
        assert m["vs_llama_cpp"] is None  # the llama.cpp peer did not run
        for c in m["by_category"].values():
            for key in ("tokens_per_second", "speedup", "decode_tokens_per_second", "decode_speedup", "ttft_s"):
                assert key in c
        if name != "hf-assisted":  # ours stream: a first token and the decoding after it
            assert 0 < m["ttft_s"] and m["decode_tokens_per_second"] > 0 and m["decode_speedup"] > 0
            assert all(
                r["ttft_s"] is not None and r["ttft_s"] <= r["wall_s"]
                for r in results["prompts"]
                if r["method"] == name
            )
    assert results["methods"]["autoregressive"]["speedup"] == 1.0
    assert results["methods"]["draft"]["greedy_agreement"] == 1.0  # lossless greedy
    assert results["methods"]["pld"]["greedy_agreement"] == 1.0
    assert results["methods"]["hf-assisted"]["mean_accepted_tokens"] is None
    assert results["methods"]["hf-assisted"]["ttft_s"] is None  # generate() gives no first-token time
    assert results["methods"]["autoregressive"]["decode_speedup"] == 1.0
    assert results["methods"]["draft"]["analytic_bound"] > 0
    assert len(results["prompts"]) == 3 * 4
    # interleaved prompt by prompt, each prompt's round starting one method later
    assert [r["method"] for r in results["prompts"]] == [
        "autoregressive",
        "draft",
        "pld",
        "hf-assisted",
        "draft",
        "pld",
        "hf-assisted",
        "autoregressive",
        "pld",
        "hf-assisted",
        "autoregressive",
        "draft",
    ]
    report = (out / "report.md").read_text()
    assert "| draft |" in report and "Speedup by category" in report
    assert "## Prefill and decoding" in report and "| chat | draft |" in report
    for png in ("speedup.png", "acceptance.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_bench_reuses_what_reads_no_prediction(tiny_dirs, tmp_path, capsys):
    """The same prompt sent with and without a prediction: a peer answers it once (its second row is the first's,
    marked reused); our methods run both (plain decoding too: with --route a prediction can change its engine)."""
    target, draft = tiny_dirs
    prompts = tmp_path / "edits.jsonl"
    rows = [
        {"task_id": "e1", "prompt": "def add(a, b):", "category": "edit", "prediction": "    return a + b\n"},
        {"task_id": "e2", "prompt": "def sub(a, b):", "category": "edit"},
        {"task_id": "e1-none", "prompt": "def add(a, b):", "category": "edit"},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench",
                "--prompts",
                str(prompts),
                "--methods",
                "pld,hf-assisted",
                "--max-new-tokens",
                "8",
                "--target",
                str(target),
                "--draft",
                str(draft),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    by = {(r["prompt_id"], r["method"]): r for r in results["prompts"]}
    m = "hf-assisted"
    assert by[("e1-none", m)].get("reused") and not by[("e1", m)].get("reused")
    assert by[("e1-none", m)]["wall_s"] == by[("e1", m)]["wall_s"]
    assert not by[("e2", m)].get("reused")  # another prompt: run afresh
    assert not any(r.get("reused") for r in results["prompts"] if r["method"] != m)
    assert "Reused runs: 1 (" in (out / "report.md").read_text()
    # the prompt sent again runs right after its first sending (its reused answer timed minutes before, not a
    # run's length), the rest in file order
    assert list(dict.fromkeys(r["prompt_id"] for r in results["prompts"])) == ["e1", "e1-none", "e2"]
    # control: sampled, nothing is reused (a second draw is a new measurement)
    out2 = tmp_path / "out2"
    assert (
        main(
            [
                "bench",
                "--prompts",
                str(prompts),
                "--methods",
                "pld",
                "--max-new-tokens",
                "8",
                "--temperature",
                "0.7",
                "--target",
                str(target),
                "--draft",
                str(draft),
                "--out",
                str(out2),
            ]
        )
        == 0
    )
    sampled = json.loads((out2 / "results.json").read_text())["prompts"]
    assert not any(r.get("reused") for r in sampled)
    assert list(dict.fromkeys(r["prompt_id"] for r in sampled)) == ["e1", "e2", "e1-none"]  # none reused: file order


def test_bench_tree_method(tiny_dirs, prompt_file, tmp_path, capsys):
    target, draft = tiny_dirs
    out = tmp_path / "out"
    code = main(
        [
            "bench",
            "--prompts",
            str(prompt_file),
            "--methods",
            "draft,tree",
            "--gamma",
            "3",
            "--tree-width",
            "2",
            "--max-new-tokens",
            "12",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    tree = results["methods"]["tree"]
    assert tree["greedy_agreement"] == 1.0 and tree["nodes_per_pass"] > 0
    assert tree["expected_tokens_per_pass"] >= 1 and tree["depth_per_pass"] > 0
    assert tree["analytic_bound"] is None  # the chain bound does not apply to trees
    assert results["config"]["tree"] == {"tree_width": 2} and results["config"]["pass_costs"]["target"]
    assert "## Token tree" in (out / "report.md").read_text()
    assert (
        main(
            [
                "bench",
                "--prompts",
                str(prompt_file),
                "--methods",
                "draft",
                "--tree-depth",
                "2",
                "--target",
                str(target),
                "--draft",
                str(draft),
            ]
        )
        == 2
    )


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

    data = Path(__file__).resolve().parents[3] / "shared" / "data"
    if not data.is_dir():
        pytest.skip("../shared/data is not beside this checkout")
    he = load_prompts(data / "humaneval.jsonl")
    mt = load_prompts(data / "mt_bench.jsonl")
    assert len(he) == 164 and not he[0]["chat"]
    assert len(mt) == 80 and mt[0]["chat"] and mt[0]["category"] == "writing"


def test_bench_llama_cpp_peer_prefill_and_decode(tmp_path, capsys):
    """The llama.cpp peer's first-token time, and every method's ratios against it, on tiny GGUF models."""
    pytest.importorskip("llama_cpp", reason="the llama.cpp peer needs llama-cpp-python (not installed)")
    from tinygguf import write_tiny_gguf

    target, draft = write_tiny_gguf(tmp_path / "target.gguf", 0), write_tiny_gguf(tmp_path / "draft.gguf", 1)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"prompt": "def add(a, b):", "category": "code"}\n{"prompt": "abcabcabc abcabcabc", "category": "text"}\n'
    )
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench",
                "--prompts",
                str(prompts),
                "--methods",
                "autoregressive,auto,llama.cpp",
                "--threads",
                "1",
                "--max-new-tokens",
                "12",
                "--target",
                str(target),
                "--draft",
                str(draft),
                "--backend",
                "llama.cpp",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    peer_rows = [r for r in results["prompts"] if r["method"] == "llama.cpp"]
    assert len(peer_rows) == 2 and all(0 < r["ttft_s"] <= r["wall_s"] for r in peer_rows)
    for name, m in results["methods"].items():
        assert m["ttft_s"] > 0 and m["decode_tokens_per_second"] > 0
        assert m["vs_llama_cpp"]["overall"] > 0 and m["vs_llama_cpp"]["decode"] > 0
        for c in ("code", "text"):
            assert m["by_category"][c]["vs_llama_cpp"]["overall"] > 0
    assert results["methods"]["llama.cpp"]["vs_llama_cpp"] == {"overall": 1.0, "decode": 1.0}
    assert results["methods"]["auto"]["greedy_agreement"] == 1.0
    text = (out / "report.md").read_text()
    assert "vs llama.cpp decode" in text and "| code | llama.cpp |" in text


def _devset_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "longprompt_devset.py"
    spec = importlib.util.spec_from_file_location("longprompt_devset", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_site_packages(root):
    """Two licensed distributions (long READMEs, docs, a source file of 60-200 lines) and one without a
    licence, whose texts must never be used."""
    import textwrap

    words = (
        "the parser reads each record from the stream and checks its fields before it hands them to the "
        "writer, which keeps a buffer of rows and flushes it when the buffer is full or the stream ends"
    )

    def prose(name, n):
        paras = [f"# {name}\n\n{name} is a small library for reading and writing tabular records."]
        for i in range(n):
            paras.append(
                (f"## Section {i}\n\n" if i % 3 == 0 else "")
                + f"Paragraph {i} of {name}: "
                + " ".join([words] * 3)
                + f". Call `{name}_open()` to start."
            )
        return "\n\n".join(paras) + "\n\nInstall it with `pip install " + name + "`.\n"

    def source(name):
        funcs = "\n\n".join(
            textwrap.dedent(f"""\
            def step_{i}(rows, limit):
                total = 0
                for row in rows:
                    if len(row) > limit:
                        total += len(row)
                    else:
                        total -= 1
                return "%s: %d" % ("{name}", total)
            """)
            for i in range(16)
        )
        return f'"""The {name} helpers."""\nimport os\n\n\n{funcs}'

    dists = [
        ("tabkit", "1.0", "License-Expression: MIT\n"),
        ("rowlib", "2.1", "Classifier: License :: OSI Approved :: BSD License\n"),
        ("mystery", "0.1", "License: UNKNOWN\n"),
    ]
    for name, version, lic in dists:
        info = root / f"{name}-{version}.dist-info"
        (root / name / "docs").mkdir(parents=True)
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{lic}"
            f"Description-Content-Type: text/markdown\n\n{prose(name, 24)}"
        )
        (root / name / "README.md").write_text(prose(name + " guide", 30))
        (root / name / "docs" / "usage.rst").write_text(prose(name + " usage", 30))
        (root / name / "core.py").write_text(source(name))
        (root / name / "LICENSE.md").write_text("Permission is hereby granted " * 400)
        files = [
            f"{name}/README.md",
            f"{name}/docs/usage.rst",
            f"{name}/core.py",
            f"{name}/LICENSE.md",
            f"{info.name}/METADATA",
        ]
        (info / "RECORD").write_text("".join(f"{f},sha256=x,1\n" for f in files))
    return root


def test_longprompt_devset_generator(tmp_path, capsys):
    gen = _devset_module()
    site = _fake_site_packages(tmp_path / "site-packages")
    out = tmp_path / "devset.jsonl"
    assert gen.main(["--site-packages", str(site), "--per-category", "2", "--seed", "3", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    raw = [json.loads(line) for line in out.read_text().splitlines()]
    rows = load_prompts(out)
    assert len(rows) == len(raw) and all(r["chat"] for r in rows)
    assert {r["category"] for r in rows} == {"summary", "doc_qa", "code_edit", "translation"}
    assert len({r["id"] for r in rows}) == len(rows)
    for r in raw:
        assert r["source"]["package"] in ("tabkit", "rowlib")  # never the one without a licence
        assert r["licence"] in ("MIT", "BSD License")
        assert "LICENSE" not in r["source"]["file"]
        assert 600 <= len(r["turns"][0]) / 4 <= 2000
    by = {c: [r for r in raw if r["category"] == c] for c in ("summary", "doc_qa", "code_edit", "translation")}
    assert all(len(v) == 2 for v in by.values())
    assert all(r["turns"][0].startswith("Summarize the following text") for r in by["summary"])
    assert all(r["turns"][0].startswith("Translate the following text into French") for r in by["translation"])
    assert all(r["turns"][0].startswith("Using only the text below") for r in by["doc_qa"])
    assert all(r["source"]["file"].endswith("core.py") and "def step_0" in r["turns"][0] for r in by["code_edit"])
    # deterministic given the seed
    again = tmp_path / "again.jsonl"
    gen.main(["--site-packages", str(site), "--per-category", "2", "--seed", "3", "--out", str(again)])
    assert again.read_text() == out.read_text()
    # the default output goes to the specdecode cache (SPECDECODE_CACHE in the tests)
    from specdecode.backends import cache_dir

    assert gen.default_out() == cache_dir() / "devset" / "longprompt.jsonl"


def test_llama_cpp_peer_runs_in_a_process_of_its_own(tmp_path):
    """The llama-cpp-python peer decodes in a child process (in one process the model loaded first decodes
    slower): greedy output equals Llama's in this process, and a child that dies is a clear error, not a hang."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="the llama.cpp peer needs llama-cpp-python (not installed)")
    import os
    from types import SimpleNamespace

    from specdecode.bench.peers import LlamaPeer
    from specdecode.errors import SpecDecodeError
    from tinygguf import write_tiny_gguf

    target = write_tiny_gguf(tmp_path / "target.gguf", 0)
    lm = SimpleNamespace(gguf_path=target, max_length=256, threads=1, repack=True)
    peer = LlamaPeer(SimpleNamespace(target=lm, eos_ids=set()), pld=False, log_dir=tmp_path / "logs")
    try:
        assert peer.proc.pid != os.getpid() and peer.proc.poll() is None
        r = peer.generate([1, 2, 3, 4], 10, 0.0, None)
        llm = llama_cpp.Llama(model_path=str(target), n_ctx=256, n_threads=1, verbose=False)
        want = []
        for tok in llm.generate([1, 2, 3, 4], temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            want.append(int(tok))
            if len(want) == 10:
                break
        assert r["token_ids"] == want and r["new_tokens"] == 10 and 0 < r["ttft_s"] <= r["wall_s"]
        with pytest.raises(SpecDecodeError, match="greedy only"):
            peer.generate([1, 2], 4, 1.0, None)
        peer.proc.kill()
        peer.proc.wait()
        with pytest.raises(SpecDecodeError, match="process ended"):
            peer.generate([1, 2], 4, 0.0, None)
    finally:
        peer.close()
    assert peer.proc.poll() is not None
    with pytest.raises(SpecDecodeError, match="peer failed"):  # a file llama.cpp cannot load
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(b"GGUF" + b"\0" * 64)
        LlamaPeer(
            SimpleNamespace(
                target=SimpleNamespace(gguf_path=bad, max_length=256, threads=1, repack=True), eos_ids=set()
            ),
            pld=False,
            log_dir=tmp_path / "logs",
        )


def test_copy_bound_on_known_pass_costs():
    """A perfect copy takes, at each token's context, the timed pass size that costs least per token."""
    from specdecode.bench.bound import copy_bound
    from specdecode.planning.costs import CostModel

    flat = CostModel({1: 0.04, 16: 0.16, 32: 0.64})  # 16 tokens for 4 plain steps: 0.01 s a token
    assert copy_bound(flat, 100, 11) == pytest.approx(10 / (10 * 0.01))
    assert copy_bound(CostModel({1: 0.04, 2: 0.09}), 100, 5) == pytest.approx(25.0)  # no bigger pass pays: plain
    assert copy_bound(flat, 100, 1) is None


def test_oracle_bound_knows_the_edit_points():
    """The plan that knows where the answer leaves the prediction: a copied run rides the cheapest passes, a changed
    token is a pass's bonus; a prediction that shares nothing is decoded plainly."""
    from specdecode.bench.bound import copy_bound, oracle_bound
    from specdecode.planning.costs import CostModel

    costs = CostModel({1: 0.04, 16: 0.16})
    answer = list(range(100, 133))  # 33 tokens: the first comes from the prompt's read, 32 are decoded
    assert oracle_bound(costs, 50, answer, answer) == pytest.approx(copy_bound(costs, 50, 33))  # two 16-token passes
    changed = answer[:10] + [7] + answer[11:]
    # 1..10 in one pass (token 10 its bonus), 11..26 in a second, 27..32 in a third padded to 16: 3 x 0.16 s
    assert oracle_bound(costs, 50, changed, answer) == pytest.approx(32 / 0.48)
    assert oracle_bound(costs, 50, answer, [1, 2, 3]) == pytest.approx(25.0)  # nothing copied: plain steps
    assert oracle_bound(costs, 50, answer[:1], answer) is None


def test_timed_copy_bound_verifies_the_answer_in_the_cheapest_passes():
    """The timed perfect copy reads the prompt (only where the cache does not hold it), then feeds the answer's own
    tokens in the pass sizes the cost table prices best per token, and leaves the cache empty."""
    import torch

    from specdecode.bench.bound import timed_copy_bound
    from specdecode.planning.costs import CostModel

    class Recorder:
        def __init__(self, ids=()):
            self.fed, self.ids = [], list(ids)
            self.trunk = len(self.ids)

        def reset(self):
            self.ids = []

        def rollback(self, length):
            self.ids = self.ids[:length]

        def forward(self, ids, last_only=False):
            self.fed.append(list(ids))
            self.ids += list(ids)
            return torch.zeros(1 if last_only else len(ids), 8)

        def synchronize(self):
            pass

    costs, prompt, answer = CostModel({1: 0.04, 4: 0.08, 8: 0.24}), [1, 2, 3], list(range(200, 221))  # 20 decoded
    lm = Recorder()
    assert timed_copy_bound(lm, costs, prompt, answer) > 0 and lm.ids == []
    assert lm.fed[0] == [1, 2, 3]
    assert [len(x) for x in lm.fed[1:]] == [4] * 5  # 4 tokens for 2 plain steps is the cheapest per token
    assert sum(lm.fed[1:], []) == answer[:20]  # each pass feeds the last token written and the next guesses
    # the answer's generation left the prompt and the answer cached: the prompt is not read again
    lm = Recorder(prompt + answer)
    assert timed_copy_bound(lm, costs, prompt, answer) > 0 and lm.ids == []
    assert sum(lm.fed, []) == answer[:20]
    lm = Recorder([1, 9])  # another text's cells: only the common start is kept, the rest of the prompt read
    timed_copy_bound(lm, costs, prompt, answer)
    assert lm.fed[0] == [2, 3]


def test_bench_reports_copies_against_their_bound(tiny_dirs, tmp_path, capsys, monkeypatch):
    target, draft = tiny_dirs
    prompts = tmp_path / "edits.jsonl"
    rows = [
        {"task_id": "e1", "prompt": "def add(a, b):", "category": "edit", "prediction": "    return a + b\n"},
        {"task_id": "e2", "prompt": "def sub(a, b):", "category": "edit"},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench",
                "--prompts",
                str(prompts),
                "--methods",
                "auto",
                "--max-new-tokens",
                "8",
                "--target",
                str(target),
                "--draft",
                str(draft),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    by = {(r["prompt_id"], r["method"]): r for r in json.loads((out / "results.json").read_text())["prompts"]}
    e1 = by[("e1", "auto")]
    assert 0 <= e1["prediction_copied"] <= 1 and e1["copy_bound_tokens_per_second"] > 0
    copied = e1["prediction_copied"] * e1["new_tokens"]  # the generation's accepted_prediction_tokens
    assert copied == pytest.approx(round(copied))
    assert e1["oracle_tokens_per_second"] > 0
    assert "copy_bound_tokens_per_second" not in by[("e2", "auto")]  # no prediction: no bound
    assert "autoregressive" in {m for _, m in by} and "copy_bound_tokens_per_second" not in by[("e1", "autoregressive")]
    report = (out / "report.md").read_text()
    assert (
        "## Copies against their bound" in report
        and "| e1 | auto |" in report
        and "| e2 |" not in report.split("## Copies against their bound")[1].split("##")[0]
    )
    assert e1["timed_copy_bound_tokens_per_second"] is None  # a partial copy: not timed
    # a copy (here: at least half, the tiny byte model's text does not re-tokenize to its ids) is also timed in the run
    for module in ("specdecode.bench.run", "specdecode.bench.report"):
        monkeypatch.setattr(importlib.import_module(module), "COPIED", 0.5)
    prompts.write_text(json.dumps({**rows[0], "prediction": e1["text"]}) + "\n")
    args = ["bench", "--prompts", str(prompts), "--methods", "auto", "--max-new-tokens", "8"]
    assert main(args + ["--target", str(target), "--draft", str(draft), "--out", str(tmp_path / "again")]) == 0
    (whole,) = [
        r for r in json.loads((tmp_path / "again" / "results.json").read_text())["prompts"] if r["method"] == "auto"
    ]
    assert whole["prediction_copied"] >= 0.5 and whole["timed_copy_bound_tokens_per_second"] > 0
    assert "✓" in (tmp_path / "again" / "report.md").read_text()
