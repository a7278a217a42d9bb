"""Predicted Outputs and copy following: the alignment (drafters/copy.py), the planner that rides long copies
(planning/tree.py), and the prediction through Engine, CLI, bench and the OpenAI-compatible server.

Greedy output never depends on the prediction (it is a source of guesses the target verifies); the sampled
law with a prediction drafting is checked in test_lossless_engine (the auto-prediction case and its controls)."""

from __future__ import annotations

import json

import openai
import pytest

from helpers import LiveServer, http, run
from specdecode import Engine, SpecDecodeError
from specdecode.backends import CachedLM
from specdecode.drafters import Alignment, copy
from specdecode.drafters.copy import copy_values
from specdecode.drafters.lookup import Lookup
from specdecode.planning.costs import CostModel
from specdecode.planning.tree import TreeDrafter
from tiny import char_tokenizer, tiny_model

# pass costs in plain steps as measured with llama.cpp's Q4 on a 2-core Xeon (a 16-token pass ~3.4 plain steps)
XEON = CostModel({1: 1.0, 2: 1.53, 3: 2.08, 4: 1.53, 8: 2.97, 16: 3.39, 32: 6.10, 64: 12.2}, {})
# a pass of any size costs about one plain step (bf16 with AMX): copies pay as deep as they go
FLAT = CostModel({1: 1.0, 2: 1.0, 4: 1.01, 8: 1.02, 16: 1.04, 32: 1.1, 64: 1.3}, {})


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)


# -- the alignment ----------------------------------------------------------------------------------------------------
def follow(ref, out, start=0, aligned=True):
    a = Alignment(ref, "prediction", start, aligned)
    a.follow(list(range(1000, 1000 + start)) + out)
    return a


def test_alignment_follows_an_exact_copy():
    ref = list(range(100))
    a = follow(ref, ref[:40])
    assert (a.pos, a.run, a.breaks, a.copied) == (40, 40, 0, 40)
    g = a.guess(list(range(40)), 10)
    assert g.tokens == ref[40:50] and g.source == "prediction"
    assert all(1 >= x > y > 0 for x, y in zip(g.values, g.values[1:]))  # a path is worth less the deeper it goes


@pytest.mark.parametrize("edit", ["insert", "delete", "change"])
def test_alignment_resumes_after_an_edit(edit):
    ref = list(range(200))
    out = (
        ref[:50]
        + {"insert": [900, 901, 902], "delete": [], "change": [900, 901]}[edit]
        + ref[{"insert": 50, "delete": 60, "change": 52}[edit] : 80]
    )
    a = follow(ref, out)
    assert a.breaks == 1 and a.pos == 80  # realigned: the copy goes on right after the edited span
    g = a.guess(out, 5)
    assert g.tokens == ref[80:85]


def test_alignment_prefers_the_nearest_occurrence_ahead():
    block = [7, 8, 9, 10, 11]
    ref = block + [1, 2, 3] + block + [4, 5, 6] + block + [12, 13]
    # the output copied up to the middle block's start, then an edit, then the block's tokens again
    out = ref[:9] + [99] + block
    a = follow(ref, out)
    assert a.pos == 13  # the middle block's end (the nearest ahead of where the copy broke), not the first or the last
    assert a.guess(out, 3).tokens == [4, 5, 6]


def test_alignment_takes_the_longest_common_run():
    ref = [1, 2, 3, 0, 2, 3, 4, 0, 1, 2, 3, 4, 5]
    a = Alignment(ref, "context", 0, False)
    a.follow([1, 2, 3, 4])  # aligned after "1 2 3" on the first occurrence; "4" breaks it
    # "2 3 4" ends at 7 (nearer, a common run of 3) and at 12 (a common run of 4): the longer run wins
    assert (a.pos, a.run, a.breaks) == (12, 4, 1)
    assert a.guess([1, 2, 3, 4], 3).tokens == [5]


def test_alignment_of_the_prompt_waits_for_a_match_and_ignores_the_prompt_itself():
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    a = Alignment(prompt, "context", len(prompt), False)
    assert a.guess(prompt, 4) is None  # no output yet: nothing to follow
    assert a.guess(prompt + [7, 8], 4) is None  # fewer than SYNC_MIN output tokens
    g = a.guess(prompt + [7, 8, 9], 4)
    assert g.tokens == [10, 11, 12] and g.source == "context"


def test_a_rename_is_learned_once_and_expected_again():
    N = 99
    ref = [1, 2, 3, N, 4, 5, 6, 7, N, 8, 9, 10, 11, N, 12, 13, 14, 15, N, 16]
    out = [x for t in ref for x in ((50, 51) if t == N else (t,))]  # every N renamed to the two tokens 50 51
    a = Alignment(ref, "prediction", 0, True)
    for i in range(1, len(out) + 1):
        a.follow(out[:i])
    assert a.breaks == 1  # only the first occurrence breaks the copy: later ones are expected renamed
    b = Alignment(ref, "prediction", 0, True)
    b.follow(out[:9])  # past the first rename, realigned on "4 5 6", and 7
    assert b.guess(out[:9], 6).tokens == [50, 51, 8, 9, 10, 11]
    # where the output keeps the original span, the copy goes on without a break
    kept = out[:9] + [N, 8, 9]
    c = Alignment(ref, "prediction", 0, True)
    c.follow(kept)
    assert c.breaks == 1 and c.pos == 11


def test_a_long_run_is_worth_more_than_a_fresh_one_and_breaks_cost_trust():
    ref = list(range(300))
    long = follow(ref, ref[:100]).guess(ref[:100], 32)
    short = follow(ref, ref[:4]).guess(ref[:4], 32)
    assert long.values[15] > 0.6 > short.values[15]
    # a prediction that is wrong from the start: every token breaks it, and it is not realigned
    wrong = follow(ref, list(range(500, 540)))
    assert wrong.breaks == 1 and wrong.pos is None and wrong.guess(list(range(500, 540)), 8) is None


def test_a_copy_realigned_on_a_long_run_is_trusted_deep_at_once():
    """After an edit point, the common run that realigned the copy is the evidence: a long one on a reference with
    a clean record is trusted as deep as the record allows; a short chance match is not."""
    ref = list(range(1000, 1400))
    out = ref[:150] + [7, 8] + ref[152:172]  # 150 copied, one edit, 20 copied again
    a = follow(ref, out)
    assert a.breaks == 1 and a.run >= 20
    deep = a.guess(out, 48).values
    assert deep[31] > 0.6  # the 32nd token ahead: 0.9 ** 32 of a fresh Laplace run would give 21/53
    assert deep == copy_values(a.run, a.hazards(48), 48)  # the prediction's prior odds are even
    chance = copy_values(3, a.hazards(48), 48, odds=1 / 3)
    assert chance[15] < 0.55 * deep[15]  # the same record, a 3-token match in a prompt: backs off
    # a reference that breaks every few tokens is worth little however it was realigned
    assert copy_values(20, 0.3, 16)[7] < 0.1


def test_edit_points_cluster_so_the_tokens_near_a_realignment_are_trusted_apart():
    """A reference whose breaks came right after its realignments is trusted less just after the next one than
    further on; one that went on cleanly after its realignments is trusted near them as far on."""
    ref = list(range(1000, 1600))
    clustered = ref[:100] + [7] + ref[101:106] + [8] + ref[107:112] + [9] + ref[113:116]  # just realigned again
    a = follow(ref, clustered)
    assert a.breaks == 3 and a.near[1] == 2 and a.far[1] == 1 and a.since < copy.NEAR
    h = a.hazards(copy.NEAR + 4)
    assert h[0] > 3 * h[-1]  # the next token, near the realignment, against one past NEAR tokens from it
    clean = ref[:100] + [7] + ref[101:200] + [8] + ref[201:204]  # went on cleanly after its first realignment
    b = follow(ref, clean)
    assert b.breaks == 2 and b.near[1] == 0 and b.since < copy.NEAR and b.hazards(1)[0] < h[0] / 2
    # a list of hazards: the path to the j-th token survives each of them
    first = copy_values(5, 0.5, 1, spurious=False)[0]
    assert copy_values(5, [0.5, 0.0, 0.0], 3, spurious=False) == pytest.approx([first] * 3)


LINES = list(range(100, 112)) + [10] + [4, 5, 6] + [10] + [7, 8, 9] + [10] + [11, 12]  # lines ending on token 10


def test_an_inserted_line_resumes_the_copy_where_it_broke():
    """The copy followed the line break (token 10) before the break; the inserted line ends on the same token, and the
    original goes on right after it: the copy resumes there at once, before SYNC_MIN tokens of evidence."""
    out = LINES[:13] + [50, 51, 52, 10]  # an inserted line "50 51 52" after the first line
    a = follow(LINES, out)
    assert a.pos == 13 and a.tentative and a.breaks == 1
    g = a.guess(out, 3)
    assert g.tokens == [4, 5, 6] and all(0 < v < 1 for v in g.values)
    b = follow(LINES, out + [4, 5, 6])  # it held: a re-synchronisation like any other
    assert not b.tentative and b.held == [1, 0] and b.breaks == 1
    fresh = Alignment(LINES, "prediction", 0, True)  # a reference not yet seen copied: no short matches
    fresh.follow([50, 10])
    assert fresh.pos is None


def test_a_tentative_alignment_that_fails_is_not_a_break_of_the_copy():
    out = LINES[:13] + [50, 10, 60, 61, 10]  # a two-line insertion: the first line break resumes too early
    a = follow(LINES, out)
    assert a.breaks == 1 and a.held == [0, 1] and a.pos == 13 and a.tentative  # resumed again after the second line
    values = a.guess(out, 3).values  # one failure halves the odds of the next tentative alignment
    assert values == pytest.approx(copy_values(1, a.hazards(3), 3, odds=0.5, spurious=False))
    assert values[0] < copy_values(1, a.hazards(3), 3, spurious=False)[0]


def test_a_unique_short_match_resynchronises_after_a_deletion():
    ref = list(range(100, 160))
    out = ref[:20] + ref[30:32]  # ten tokens deleted: the next two occur once only in the prediction
    a = follow(ref, out)
    assert a.pos == 32 and a.run == 2 and a.tentative
    assert a.guess(out, 4).tokens == ref[32:36]
    prompt_copy = Alignment(ref, "context", 0, False)  # the prompt is not re-synchronised on less than SYNC_MIN
    prompt_copy.follow(ref[:20] + ref[30:32])
    assert prompt_copy.pos is None and not prompt_copy.tentative


def test_trust_drops_with_breaks():
    ref = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 3
    good = follow(ref, ref[:6]).guess(ref[:6], 4)
    a = Alignment(ref, "prediction", 0, True)
    out = []
    for _ in range(5):  # copy 3, break, and realign: 5 edit points
        out += [1, 2, 3, 99]
        a.follow(out)
    out += [1, 2, 3]
    g = a.guess(out, 4)
    assert a.breaks == 5 and g is not None and g.values[0] < good.values[0]


# -- the planner: riding copies ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


@pytest.fixture(scope="module")
def plain_out(target):
    prompt = [104, 101, 108, 108, 111, 32] * 4
    return prompt, run(CachedLM(target), None, prompt, 0, 200)[0]


def drafter(prompt, prediction, costs, **kw):
    copies = [] if prediction is None else [Alignment(prediction, "prediction", len(prompt), True)]
    copies.append(Alignment(prompt, "context", len(prompt), False))
    return TreeDrafter(None, lookup=Lookup(copies=copies), costs=costs, **kw)


def edited(out):
    """The output with a changed token, an inserted span and a deleted span: what an edit task predicts."""
    return out[:40] + [7] + out[41:90] + [1, 2, 3, 4] + out[90:150] + out[160:]


@pytest.mark.parametrize("costs", [XEON, FLAT], ids=["xeon", "flat"])
@pytest.mark.parametrize("which", ["exact", "edited", "wrong", "none"])
def test_greedy_output_never_depends_on_the_prediction(target, plain_out, costs, which):
    prompt, out = plain_out
    prediction = {"exact": out, "edited": edited(out), "wrong": [(x * 7 + 3) % 256 for x in out], "none": None}[which]
    d = drafter(prompt, prediction, costs)
    got, stats = run(CachedLM(target), d, prompt, d.depth_cap, len(out))
    assert got == out
    if which == "exact":  # the copy is ridden: deep chains, few passes
        assert stats.sources["prediction"]["accepted"] >= 0.8 * len(out)
        assert stats.target_forwards <= len(out) / 4
        assert max(i + 1 for i, n in enumerate(stats.drafted_per_position) if n) >= 16
        assert stats.strategies.get("copy", 0) >= stats.target_forwards - 2  # all but the first steps ride it
    if which == "edited":
        assert stats.sources["prediction"]["accepted"] >= 0.6 * len(out)
        assert stats.target_forwards <= len(out) / 3
    if which == "wrong":  # backed off: next to nothing verified in vain
        src = stats.sources.get("prediction", {"drafted": 0})
        assert src["drafted"] <= 6


def test_depth_follows_the_pass_costs(target, plain_out):
    prompt, out = plain_out
    deepest = {}
    for name, costs in (("xeon", XEON), ("flat", FLAT)):
        d = drafter(prompt, out, costs)
        _, stats = run(CachedLM(target), d, prompt, d.depth_cap, len(out))
        deepest[name] = len(stats.drafted_per_position)
    assert deepest["flat"] > deepest["xeon"] >= 16  # flat passes: deeper chains


def test_exact_limits_cap_the_copy_chain(target, plain_out):
    prompt, out = plain_out
    d = drafter(prompt, out, FLAT)
    d.limit(4, chains_only=True)
    got, stats = run(CachedLM(target), d, prompt, d.depth_cap, 100)
    assert got == out[:100] and len(stats.drafted_per_position) <= 4


def test_sampled_tokens_with_a_prediction_are_reproducible(target, plain_out):
    from specdecode import SamplingParams

    prompt, out = plain_out
    params = SamplingParams(temperature=0.7)
    runs = [
        run(CachedLM(target), (d := drafter(prompt, out, FLAT)), prompt, d.depth_cap, 60, params=params, seed=3)[0]
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and len(runs[0]) == 60


# -- the Engine, the CLI and the bench --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    tok = char_tokenizer()  # (a decoded output encodes back to the same tokens)
    e = Engine(tiny_model(0), tok, tiny_model(1), tok)
    e.costs, e.progress = XEON, False
    return e


PROMPT = "def add(a, b):\n    return a + b\n"


@pytest.mark.parametrize("method", ["auto", "lookup", "tree", "pld", "draft", "autoregressive"])
def test_engine_greedy_output_is_the_same_with_a_prediction(engine, method):
    plain = engine.generate(PROMPT, method=method, max_new_tokens=80)
    with_own = engine.generate(PROMPT, method=method, max_new_tokens=80, prediction=plain.text)
    with_other = engine.generate(PROMPT, method=method, max_new_tokens=80, prediction="x = [1, 2, 3]\n" * 5)
    assert with_own.token_ids == with_other.token_ids == plain.token_ids
    src = with_own.stats.sources.get("prediction")
    if method in ("auto", "lookup", "tree", "pld"):
        assert src is not None and src["accepted"] > 0 and "prediction" in with_own.stats.lookup_sources
        assert with_own.stats.target_forwards < plain.stats.target_forwards
    else:  # no lookup sources: the prediction is not drafted from
        assert src is None


def test_engine_refuses_a_prediction_that_is_not_text(engine):
    with pytest.raises(SpecDecodeError, match="prediction must be a string"):
        engine.generate(PROMPT, prediction=["a"])


def test_cli_generate_with_a_prediction_file_and_stdin(tiny_dirs, tmp_path, capsys, monkeypatch):
    import io

    from specdecode.cli import main

    target, draft = tiny_dirs
    base = [
        "generate",
        PROMPT,
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--backend",
        "torch",
        "--method",
        "lookup",
        "--max-new-tokens",
        "24",
        "--json",
    ]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    pred = tmp_path / "pred.txt"
    pred.write_text(plain["text"])
    assert main(base + ["--prediction", str(pred)]) == 0
    got = json.loads(capsys.readouterr().out)
    # (the byte tokenizer's text need not encode back to the same tokens: the Engine test counts acceptances)
    assert got["token_ids"] == plain["token_ids"] and "prediction" in got["stats"]["lookup_sources"]
    monkeypatch.setattr("sys.stdin", io.StringIO(plain["text"]))
    assert main(base + ["--prediction", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
    assert main(base + ["--prediction", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_bench_reads_a_prediction_per_prompt(tmp_path):
    from specdecode.launch.prompts import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a", "prediction": "b"}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    rows = load_prompts(path)
    assert rows[0]["prediction"] == "b" and "prediction" not in rows[1]
    path.write_text(json.dumps({"prompt": "a", "prediction": 3}) + "\n")
    with pytest.raises(SpecDecodeError, match="'prediction' must be a string"):
        load_prompts(path)


# -- the server -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(engine):
    from specdecode.server import create_app

    srv = LiveServer(create_app(engine, model_id="tiny", method="auto"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": "fix the typo: def add(a, b):\n    retrun a + b\n"}]


def test_openai_client_sends_a_prediction_and_reads_the_usage(client):
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0)
    text = plain.choices[0].message.content
    d = plain.usage.completion_tokens_details
    assert (d.accepted_prediction_tokens, d.rejected_prediction_tokens) == (0, 0)

    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=60, temperature=0, prediction={"type": "content", "content": text}
    )
    assert out.choices[0].message.content == text
    d = out.usage.completion_tokens_details
    # the prediction is the answer (one token a character): every token of it appears, none is rejected
    assert (d.accepted_prediction_tokens, d.rejected_prediction_tokens) == (len(text), 0)
    wrong = text[:10] + "QQQQ" + text[10:]  # four tokens the answer does not have, then the answer's own
    again = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=60, temperature=0, prediction={"type": "content", "content": wrong}
    )
    d = again.usage.completion_tokens_details
    assert again.choices[0].message.content == text
    assert (d.accepted_prediction_tokens, d.rejected_prediction_tokens) == (len(text), 4)
    spec = out.model_extra["speculation"]
    assert spec["target_forwards"] < plain.model_extra["speculation"]["target_forwards"]

    # text parts, streamed, with the usage chunk
    half = len(text) // 2
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=60,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            prediction={
                "type": "content",
                "content": [{"type": "text", "text": text[:half]}, {"type": "text", "text": text[half:]}],
            },
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    last = chunks[-1]
    assert (
        last.choices == []
        and last.usage.completion_tokens_details.accepted_prediction_tokens == d.accepted_prediction_tokens
    )


def test_completions_take_a_prediction_too(live):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40}
    plain = http.post(f"{live.url}/v1/completions", json=body, timeout=60).json()
    out = http.post(
        f"{live.url}/v1/completions",
        timeout=60,
        json={**body, "prediction": {"type": "content", "content": plain["choices"][0]["text"]}},
    ).json()
    assert out["choices"][0]["text"] == plain["choices"][0]["text"]
    assert out["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0


@pytest.mark.parametrize(
    "prediction",
    [
        {"type": "text", "content": "x"},
        {"type": "content"},
        {"type": "content", "content": 3},
        {"type": "content", "content": [{"type": "image_url", "image_url": "x"}]},
        "just a string",
        {"type": "content", "content": "x", "extra": 1},
    ],
)
def test_a_bad_prediction_is_a_400(live, prediction):
    r = http.post(
        f"{live.url}/v1/chat/completions",
        timeout=60,
        json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "prediction": prediction},
    )
    assert r.status_code == 400, r.text
    assert "prediction" in json.dumps(r.json()["error"])
