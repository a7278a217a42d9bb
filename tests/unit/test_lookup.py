"""The lookup drafter's indexes against brute force, its errors, and greedy equality of every source."""

import json
import random

import numpy as np
import pytest

from helpers import CHEAP
from specdecode import Engine, SpecDecodeError, builders
from specdecode.drafters import (
    Datastore,
    History,
    Lookup,
    NgramIndex,
    build_datastore,
    index_files,
    tokenizer_fingerprint,
)
from specdecode.drafters.lookup import continuation_tree
from specdecode.drafters.sources import SEP
from tiny import byte_tokenizer, tiny_model

# ============================================================= brute force


def brute_matches(seqs: list[list[int]], text: list[int], max_n: int):
    """Longest suffix of text (<= max_n) that occurs in a sequence with at least one token after it;
    returns (n, {(sequence, end)}) with end the index after the occurrence."""
    for n in range(min(max_n, len(text)), 0, -1):
        pat = text[-n:]
        hits = {(s, i + n) for s, seq in enumerate(seqs) for i in range(len(seq) - n) if seq[i : i + n] == pat}
        if hits:
            return n, hits
    return 0, set()


def random_stream(rng, n, alphabet):
    # repetitive: short motifs copied around, so long matches exist
    out = []
    while len(out) < n:
        if out and rng.random() < 0.5:
            i = rng.randrange(len(out))
            out += out[i : i + rng.randint(2, 8)]
        else:
            out.append(rng.randrange(alphabet))
    return out[:n]


@pytest.mark.parametrize("seed", range(20))
def test_ngram_index_finds_what_a_scan_finds(seed):
    rng = random.Random(seed)
    seqs = [random_stream(rng, rng.randint(1, 60), rng.choice([2, 3, 5, 20])) for _ in range(rng.randint(1, 4))]
    index = NgramIndex(max_n=4)
    starts = []
    for s in seqs:
        starts.append(len(index))
        index.extend(s + [SEP])
    for _ in range(30):
        text = random_stream(rng, rng.randint(1, 10), 5)
        n, ends = index.match(text, limit=10**6)
        bn, hits = brute_matches(seqs, text, 4)
        assert n == bn
        found = set()
        for e in ends:
            s = max(k for k, st in enumerate(starts) if st <= e)
            found.add((s, e - starts[s]))
            assert index.continuation(e, 5) == seqs[s][e - starts[s] : e - starts[s] + 5]
        assert found == hits
        assert ends == sorted(ends, reverse=True)  # latest first
        n2, few = index.match(text, limit=3)
        assert n2 == n and few == ends[:3]


def test_context_match_excludes_the_text_itself():
    index = NgramIndex()
    index.extend([1, 2, 3, 1, 2])
    n, ends = index.match([1, 2, 3, 1, 2], 10)
    assert (n, ends) == (2, [2])  # "1 2" occurred at 0 (followed by 3); the last one has no continuation
    assert index.continuation(2, 4) == [3, 1, 2]


def test_history_evicts_least_recently_used_and_matches_only_live_outputs():
    h = History(max_tokens=25, max_n=3)
    a, b, c = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18]
    h.add(a)  # stored: the output only, never its prompt
    h.add(b)
    h.add(a[:1] * 8)
    assert h.live_tokens == 20
    h.touch([0])  # a was used: b is now the least recently used
    h.add(c)
    assert set(h.live) == {0, 2, 3} and h.live_tokens == 20
    assert h.match([8, 9], 10)[0] == 0  # b is gone
    n, ends = h.match([99, 2, 3], 10)
    assert n == 2 and [h.index.continuation(e, 3) for e in ends] == [[4, 5, 6]]
    assert History(0).max_tokens == 0 and not h.add([2] * 40)  # longer than the whole history: not stored
    with pytest.raises(SpecDecodeError):
        History(-1)


@pytest.mark.parametrize("seed", range(6))
def test_history_against_brute_force_through_compactions(seed):
    rng = random.Random(seed)
    h = History(max_tokens=rng.randint(20, 80), max_n=3)
    live: dict[int, list[int]] = {}
    for k in range(40):
        out = random_stream(rng, rng.randint(1, 12), 4)
        before = dict(h.live)
        h.add(out)
        if k in h.live:
            live[k] = out
        live = {s: v for s, v in live.items() if s in h.live}
        assert set(live) == set(h.live), (before, h.live)
        if rng.random() < 0.3 and live:
            h.touch([rng.choice(list(live))])
        text = random_stream(rng, rng.randint(1, 6), 4)
        n, ends = h.match(text, 10**6)
        ids = sorted(live)
        bn, hits = brute_matches([live[s] for s in ids], text, 3)
        assert n == bn
        got = {(h.sequence_at(e), tuple(h.index.continuation(e, 4))) for e in ends}
        want = {(ids[s], tuple(live[ids[s]][e : e + 4])) for s, e in hits}
        assert got == want
    assert len(h.index) <= 3 * h.max_tokens + 200  # compacted now and then


@pytest.mark.parametrize("seed", range(8))
def test_datastore_finds_what_a_scan_finds(tmp_path, seed):
    rng = random.Random(seed)
    V = rng.choice([3, 7, 300, 70000])
    docs = [random_stream(rng, rng.randint(1, 80), V) for _ in range(rng.randint(1, 6))]
    meta = build_datastore(docs + [[]], tmp_path / "ds", "fp", vocab_size=V, progress=False)
    assert meta["tokens"] == sum(map(len, docs)) and meta["documents"] == len(docs)
    ds = Datastore(tmp_path / "ds", "fp", max_n=6)
    for _ in range(40):
        text = random_stream(rng, rng.randint(1, 9), V)
        n, ends = ds.match(text, limit=10**6)
        # a datastore match needs no continuation (the document may end there): brute force likewise
        bn = next(
            (
                k
                for k in range(min(6, len(text)), 0, -1)
                if any(d[i : i + k] == text[-k:] for d in docs for i in range(len(d) - k + 1))
            ),
            0,
        )
        assert n == bn
        if not n:
            continue
        want = sorted(
            tuple(d[i + n : i + n + 4]) for d in docs for i in range(len(d) - n + 1) if d[i : i + n] == text[-n:]
        )
        got = sorted(tuple(c) for c in ds.continuations(ends, 4))
        assert got == want
        n3, few = ds.match(text, limit=3)
        assert n3 == n and len(few) == min(3, len(ends)) and set(few.tolist()) <= set(ends.tolist())


def test_continuation_tree_counts_and_order():
    conts = [[1, 2, 3], [1, 2, 4], [1, 5], [6]]
    g = continuation_tree(conts, [None] * 4, 2, "context", max_nodes=10)
    assert [(x.token, x.parent, x.depth, x.count) for x in g][:2] == [(1, -1, 1, 3), (2, 0, 2, 2)]
    assert {(x.token, x.depth, x.count, round(x.freq, 3)) for x in g} == {
        (1, 1, 3, 0.75),
        (6, 1, 1, 0.25),
        (2, 2, 2, 0.667),
        (5, 2, 1, 0.333),
        (3, 3, 1, 0.5),
        (4, 3, 1, 0.5),
    }
    assert all(x.parent < i for i, x in enumerate(g))
    assert len(continuation_tree(conts, [None] * 4, 2, "context", max_nodes=3)) == 3


# ============================================================= errors


def test_datastore_errors(tmp_path):
    with pytest.raises(SpecDecodeError, match="not found"):
        Datastore(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecDecodeError, match="not a complete"):
        Datastore(tmp_path / "empty")
    with pytest.raises(SpecDecodeError, match="no tokens"):
        build_datastore([[], []], tmp_path / "ds0", "fp", vocab_size=10, progress=False)
    with pytest.raises(SpecDecodeError, match="outside the vocabulary"):
        build_datastore([[1, 99]], tmp_path / "ds1", "fp", vocab_size=10, progress=False)
    build_datastore([[1, 2, 3]], tmp_path / "ds", "fp", vocab_size=10, progress=False)
    with pytest.raises(SpecDecodeError, match="different tokenizer"):
        Datastore(tmp_path / "ds", "other")
    (tmp_path / "ds" / "tokens.bin").write_bytes(b"\0" * 8)  # damaged
    with pytest.raises(SpecDecodeError, match="damaged"):
        Datastore(tmp_path / "ds", "fp")


def test_index_files_errors_and_contents(tmp_path):
    tok = byte_tokenizer()
    with pytest.raises(SpecDecodeError, match="no such file"):
        index_files([str(tmp_path / "missing")], tok, tmp_path / "out", progress=False)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "empty.py").write_text("")
    (tmp_path / "src" / "blank.py").write_text("\n\n")
    with pytest.raises(SpecDecodeError, match="no tokens"):
        index_files([str(tmp_path / "src")], tok, tmp_path / "out", progress=False)
    (tmp_path / "src" / "skip.bin").write_bytes(b"\x00\x01")
    (tmp_path / "none").mkdir()
    with pytest.raises(SpecDecodeError, match="no files"):
        index_files([str(tmp_path / "none")], tok, tmp_path / "o", progress=False)
    (tmp_path / "src" / "a.py").write_text("def add(a, b):\n    return a + b\n")
    meta = index_files([str(tmp_path / "src")], tok, tmp_path / "out", progress=False)
    assert meta["files"] == 3 and meta["documents"] == 1  # the empty ones hold no tokens; skip.bin is not text
    ds = Datastore(tmp_path / "out", tokenizer_fingerprint(tok))
    ids = tok("def add(a, b):\n    return", add_special_tokens=False)["input_ids"]
    n, ends = ds.match(ids, 8)
    assert n == 16 and tok.decode(ds.continuations(ends, 6)[0]) == " a + b"
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["fingerprint"] == tokenizer_fingerprint(tok)


# ============================================================= through the engine (greedy equality)

TEXTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "hello world, hello world, hello there world\n",
]


@pytest.fixture
def engine(tmp_path, make_engine):
    tok = byte_tokenizer()
    index_dir = tmp_path / "src"
    index_dir.mkdir()
    for i, t in enumerate(TEXTS):
        (index_dir / f"f{i}.py").write_text(t * 3)
    index_files([str(index_dir)], tok, tmp_path / "ds", progress=False)
    eng = make_engine(tokenizer=tok, history_tokens=10_000, datastore=str(tmp_path / "ds"), costs=CHEAP, progress=False)
    return eng


def test_every_source_keeps_greedy_output(engine):
    prompts = ["def add(a, b):", "hello world, hello", "xyz"]
    plain = {p: engine.generate(p, method="autoregressive", max_new_tokens=40).token_ids for p in prompts}
    engine.history.clear()
    accepted = {}
    for rnd in range(2):  # the second round also drafts from the first round's outputs
        for method in ("lookup", "tree", "auto"):
            for p in prompts:
                out = engine.generate(p, method=method, max_new_tokens=40)
                assert out.token_ids == plain[p], (method, p)
                assert out.stats.lookup_sources == ["context", "history", "datastore"]
                for s, v in out.stats.sources.items():
                    accepted[s] = accepted.get(s, 0) + v["accepted"]
                assert sum(v["accepted"] for v in out.stats.sources.values()) == out.stats.accepted
    # the tiny target's own greedy text is not in the datastore, but all three sources were tried
    assert accepted.get("context", 0) > 0 and accepted.get("history", 0) > 0, accepted


def test_datastore_guesses_are_accepted_when_the_target_writes_them(tmp_path):
    """A datastore holding exactly what the target writes: lookup alone, no draft model, accepts it."""
    tok = byte_tokenizer()
    eng = _target_only_engine(tok)
    prompt = "the quick brown"
    plain = eng.generate(prompt, method="autoregressive", max_new_tokens=60)
    ids = eng.encode(prompt) + plain.token_ids
    build_datastore([ids], tmp_path / "ds", tokenizer_fingerprint(tok), vocab_size=257, progress=False)
    eng.use_datastore(str(tmp_path / "ds"))
    out = eng.generate(prompt, method="lookup", max_new_tokens=60)
    assert out.token_ids == plain.token_ids
    assert out.stats.sources["datastore"]["accepted"] >= 40
    assert out.stats.target_forwards <= 20
    with pytest.raises(SpecDecodeError, match="different tokenizer"):
        Engine(tiny_model(0), _other_tokenizer(), datastore=str(tmp_path / "ds"))


def _target_only_engine(tok):
    """The tiny target alone (no draft model), with hand-made pass costs."""
    eng = Engine(tiny_model(0), tok)
    eng.costs, eng.progress = CHEAP, False
    return eng


def _other_tokenizer():
    tok = byte_tokenizer()
    tok.add_tokens(["<extra>"])
    return tok


def test_lookup_method_needs_no_draft_model_and_stays_a_chain_without_trees(monkeypatch):
    tok = byte_tokenizer()
    eng = _target_only_engine(tok)
    prompt = "abc abc abc abd abc abe abc"
    plain = eng.generate(prompt, method="autoregressive", max_new_tokens=30)
    out = eng.generate(prompt, method="lookup", max_new_tokens=30)
    assert out.token_ids == plain.token_ids and "draft" not in out.stats.sources
    monkeypatch.setattr(builders, "tree_error", lambda target, model: "no trees here")
    out = eng.generate(prompt, method="lookup", max_new_tokens=30)
    assert out.token_ids == plain.token_ids and out.stats.strategies.get("tree", 0) == 0


def test_lookup_is_fast_on_a_large_datastore(tmp_path):
    """Lookups stay well under a millisecond per step (a correctness guard against an accidental scan:
    the timing goal itself lives in the benchmark; here a generous bound on a 2M-token store)."""
    import time

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50_000, 1000).tolist() for _ in range(2000)]
    build_datastore(docs, tmp_path / "ds", "fp", vocab_size=50_000, progress=False)
    lk = Lookup(datastore=Datastore(tmp_path / "ds", "fp"))
    text = docs[7][:300]
    lk.prefill(text)
    t = time.perf_counter()
    for i in range(200):
        g = lk.tree(text + [i], 8, 24)
    per_step = (time.perf_counter() - t) / 200
    assert g and per_step < 0.02, per_step


# ============================================================= CLI: index, and bench with every source


def test_cli_index_and_bench_with_datastore_history_and_turns(tiny_dirs, tmp_path, capsys):
    from specdecode.cli import main

    target, draft = tiny_dirs
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def add(a, b):\n    return a + b\n" * 5)
    assert main(["index", str(src), "--out", str(tmp_path / "ds"), "--target", str(target)]) == 0
    assert "tokens from 1 documents" in capsys.readouterr().out
    assert main(["index", str(tmp_path / "nothing"), "--out", str(tmp_path / "x"), "--target", str(target)]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["index", str(src), "--out", str(tmp_path / "x"), "--target", str(target), "--suffixes", "md"]) == 2
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"turns": ["def add(a, b):", "again, please"], "category": "chat"}\n'
        '{"turns": ["abc abc", "def add(a, b):"], "category": "chat"}\n'
    )
    out = tmp_path / "out"
    code = main(
        [
            "bench",
            "--prompts",
            str(prompts),
            "--methods",
            "pld,lookup,auto",
            "--all-turns",
            "--history-tokens",
            "5000",
            "--datastore",
            str(tmp_path / "ds"),
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
    results = json.loads((out / "results.json").read_text())
    assert len(results["prompts"]) == 2 * 2 * 4  # prompts x turns x methods
    assert {r["prompt_id"] for r in results["prompts"]} == {"1#1", "1#2", "2#1", "2#2"}
    lk = results["methods"]["lookup"]
    assert lk["greedy_agreement"] == 1.0 and set(lk["by_turn"]) == {"1", "2"}
    assert set(lk["sources"]) <= {"context", "history", "datastore"} and lk["draft_cost_per_pass"] is not None
    assert results["config"]["history_tokens"] == 5000 and results["config"]["datastore_tokens"] > 0
    report = (out / "report.md").read_text()
    assert "## Drafters: cost and where accepted tokens came from" in report and "## By turn" in report
    assert (
        main(
            [
                "bench",
                "--prompts",
                str(prompts),
                "--methods",
                "lookup",
                "--datastore",
                str(tmp_path / "nope"),
                "--target",
                str(target),
            ]
        )
        == 2
    )
