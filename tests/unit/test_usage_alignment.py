"""OpenAI's usage fields for a prediction (specdecode.prediction): exact counts on token lists, the server's Usage
reading them, and the copy drafter's n-gram index in bounded memory."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from specdecode.drafters import Alignment
from specdecode.drafters.ngram_index import NgramIndex
from specdecode.prediction import _lcs_reach, prediction_usage
from specdecode.stats import Stats

P = list(range(100, 120))  # a prediction of 20 tokens
X = [1, 2, 3, 4, 5, 6, 7, 8]  # tokens that are not in it


@pytest.mark.parametrize(
    "completion, counts",
    [
        (P, (20, 0)),
        (P[:8] + X[:3] + P[8:], (20, 0)),  # an insertion: every token of the prediction still appears
        (P[:8] + P[12:], (16, 4)),  # a deletion: the 4 tokens left out
        (P[:8] + X[:2] + P[10:], (18, 2)),  # a substitution: the 2 tokens replaced
        (X, (0, 20)),  # a prediction wrong from the start
        (P[:5] + X[:2] + P[5:10] + P[14:] + X[2:4], (16, 4)),  # several edits at once
    ],
    ids=["copy", "insertion", "deletion", "substitution", "wrong", "several"],
)
def test_a_finished_answer_counts_the_whole_prediction(completion, counts):
    assert prediction_usage(P, completion, finished=True) == counts


@pytest.mark.parametrize(
    "completion, counts",
    [
        (P[:8], (8, 0)),  # a copy cut by max_tokens: the rest of the prediction was never reached
        (P[:3] + X[:1] + P[4:8], (7, 1)),  # a substitution before the cut
        (P[:3] + P[6:11], (8, 3)),  # a deletion before the cut: the completion went past the 3 tokens
        (P[:3] + X[:2] + P[3:6], (6, 0)),  # an insertion before the cut: it reached 2 tokens less far, none rejected
        (X, (0, 8)),  # wrong from the start: each token written could have been the prediction's next
        (P[:5] + X[:3], (5, 3)),  # cut after 3 tokens of its own: as many of the prediction's counted as not taken
        (P + X, (20, 0)),  # longer than the prediction: it counts no more than the prediction has
    ],
    ids=["copy", "substitution", "deletion", "insertion", "wrong", "own-tail", "past-the-end"],
)
def test_a_cut_answer_counts_the_prediction_as_far_as_it_could_reach(completion, counts):
    assert prediction_usage(P, completion, finished=False) == counts


def test_the_alignment_is_the_longest_common_subsequence():
    """Against the textbook table on random short sequences: the length, and the shortest prefix that has it."""
    rng = random.Random(0)
    for _ in range(2000):
        x = [rng.randrange(4) for _ in range(rng.randrange(14))]
        y = [rng.randrange(4) for _ in range(rng.randrange(14))]
        table = [[0] * (len(y) + 1) for _ in range(len(x) + 1)]
        for i, a in enumerate(x):
            for j, b in enumerate(y):
                table[i + 1][j + 1] = table[i][j] + 1 if a == b else max(table[i][j + 1], table[i + 1][j])
        best = table[len(x)][len(y)]
        reach = min(i for i in range(len(x) + 1) if table[i][len(y)] == best)
        assert _lcs_reach(x, y) == (best, reach), (x, y)
        accepted, rejected = prediction_usage(x, y, finished=True)
        assert (accepted, rejected) == (best, len(x) - best)


def test_an_edit_of_a_long_file_is_counted_exactly():
    rng = random.Random(1)
    pred = [rng.randrange(50_000) for _ in range(8000)]
    out = pred[:3000] + [60_001, 60_002] + pred[3010:6000] + pred[6000:6100] * 2 + pred[6100:]
    assert prediction_usage(pred, out, finished=True) == (7990, 10)


def test_stats_count_the_prediction_by_how_the_answer_ended():
    for reason, counts in (("eos", (8, 12)), ("stop", (8, 12)), ("length", (8, 0)), (None, (8, 0))):
        s = Stats(finish_reason=reason)
        s.count_prediction(tuple(P), P[:8])
        assert (s.accepted_prediction_tokens, s.rejected_prediction_tokens) == counts
        assert s.as_dict()["rejected_prediction_tokens"] == counts[1]


def test_the_server_usage_reports_the_alignment_not_the_drafting():
    from specdecode.server.protocol import Usage

    spec = Stats(
        sources={"prediction": {"drafted": 30, "accepted": 12}},
        accepted_prediction_tokens=20,
        rejected_prediction_tokens=0,
    ).as_dict()
    d = Usage.of(5, 23, spec).completion_tokens_details
    assert (d.accepted_prediction_tokens, d.rejected_prediction_tokens) == (20, 0)
    d = Usage.of(5, 23, Stats().as_dict()).completion_tokens_details  # no prediction
    assert (d.accepted_prediction_tokens, d.rejected_prediction_tokens) == (0, 0)


# -- the copy drafter's index -----------------------------------------------------------------------------------------
def test_the_ngram_index_finds_every_occurrence_in_order():
    rng = random.Random(2)
    tokens = [rng.randrange(6) for _ in range(3000)]
    index = NgramIndex(tokens, 3)
    expected: dict[tuple, list[int]] = {}
    for end in range(3, len(tokens) + 1):
        expected.setdefault(tuple(tokens[end - 3 : end]), []).append(end)
    for key, ends in expected.items():
        assert list(index.get(key)) == ends
    assert not index.get((7, 7, 7)) and not index.get((1, 2)) and len(index) == len(tokens) - 2
    with pytest.raises(ValueError):
        NgramIndex([1 << 22, 1, 2], 3)


def test_the_copy_index_takes_12_bytes_a_reference_token():
    """What following a long prediction holds: the reference's list (8 bytes a token) and its index (12)."""
    rng = random.Random(3)
    n = 200_000
    reference = [rng.randrange(1000, 150_000) for _ in range(n)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        a = Alignment(reference, "prediction", 0, True)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held <= 24 * n, f"{held / n:.0f} bytes a token"
    a.follow(reference[:50] + [7, 8] + reference[60:70])  # still follows the copy through an edit
    assert a.pos == 70
