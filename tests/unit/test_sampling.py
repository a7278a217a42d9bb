"""Unit tests for specdecode.sampling: SamplingParams validation and probs_from_logits."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams, probs_from_logits, sample


def _logits_from_probs(probs):
    return torch.tensor([math.log(x) for x in probs], dtype=torch.float32)


# ----------------------------------------------------------------------------- greedy


def test_default_params_are_greedy():
    params = SamplingParams()
    assert params.greedy
    assert not SamplingParams(temperature=0.5).greedy


def test_greedy_is_one_hot_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 11, generator=gen) * 3
    probs = probs_from_logits(logits, SamplingParams(temperature=0.0))
    assert probs.dtype == torch.float32
    assert probs.shape == logits.shape
    expected = torch.nn.functional.one_hot(logits.argmax(-1), 11).float()
    assert torch.equal(probs, expected)


def test_greedy_ignores_top_k_and_top_p():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    probs = probs_from_logits(logits, SamplingParams(temperature=0.0, top_k=2, top_p=0.3))
    assert torch.equal(probs, torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_half_precision_logits_give_float32_probs():
    logits = torch.tensor([0.5, 1.5, -0.25, 0.0], dtype=torch.float16)
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        probs = probs_from_logits(logits, params)
        assert probs.dtype == torch.float32
        assert probs.sum().item() == pytest.approx(1.0, abs=1e-6)


# ----------------------------------------------------------------------------- temperature


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 1.8, 5.0])
def test_temperature_equals_softmax_of_scaled_logits(temperature):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 9, generator=gen) * 2
    probs = probs_from_logits(logits, SamplingParams(temperature=temperature))
    expected = torch.softmax(logits.double() / temperature, dim=-1).float()
    torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5), rtol=0, atol=1e-6)


def test_lower_temperature_sharpens():
    logits = torch.tensor([1.0, 2.0, 3.0])
    cold = probs_from_logits(logits, SamplingParams(temperature=0.5))
    warm = probs_from_logits(logits, SamplingParams(temperature=2.0))
    assert cold[2] > warm[2]
    assert cold[0] < warm[0]


# ----------------------------------------------------------------------------- top-k


@pytest.mark.parametrize("k", [1, 2, 3, 5, 7])
def test_top_k_keeps_exactly_k_largest(k):
    gen = torch.Generator().manual_seed(2)
    # distinct values (a random permutation) so there are no ties at the k-th position
    logits = torch.stack([torch.randperm(8, generator=gen).float() * 0.37 for _ in range(6)])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.3, top_k=k))
    assert ((probs > 0).sum(-1) == k).all()
    topk = logits.topk(k, dim=-1).indices
    kept = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, topk, True)
    assert (probs[~kept] == 0).all()
    # renormalized softmax over the kept logits
    expected = torch.softmax((logits / 1.3).masked_fill(~kept, -math.inf).double(), -1).float()
    torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-7)


def test_top_k_hand_example():
    logits = _logits_from_probs([0.1, 0.4, 0.2, 0.3])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(probs, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("k", [0, 6, 100])
def test_top_k_zero_or_at_least_vocab_is_noop(k):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 6, generator=gen)
    params = SamplingParams(temperature=0.9, top_k=k)
    base = probs_from_logits(logits, SamplingParams(temperature=0.9))
    assert torch.equal(probs_from_logits(logits, params), base)


# ----------------------------------------------------------------------------- top-p


@pytest.mark.parametrize(
    "top_p, expected",
    [
        # sorted: 0.4 (idx 1), 0.3 (idx 3), 0.2 (idx 2), 0.1 (idx 0)
        (0.3, [0.0, 1.0, 0.0, 0.0]),  # the top token alone reaches 0.3
        (0.4 - 1e-3, [0.0, 1.0, 0.0, 0.0]),
        (0.4 + 1e-3, [0.0, 4 / 7, 0.0, 3 / 7]),  # needs the second token
        (0.6, [0.0, 4 / 7, 0.0, 3 / 7]),
        (0.85, [0.0, 4 / 9, 2 / 9, 3 / 9]),  # 0.4+0.3 < 0.85 <= 0.9
        (0.95, [0.1, 0.4, 0.2, 0.3]),  # needs all four
        (1e-6, [0.0, 1.0, 0.0, 0.0]),  # tiny top_p still keeps the argmax
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_mass(top_p, expected):
    logits = _logits_from_probs([0.1, 0.4, 0.2, 0.3])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(probs, torch.tensor(expected), rtol=1e-5, atol=1e-7)
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_top_p_batched_rows_are_independent():
    logits = torch.stack(
        [
            _logits_from_probs([0.1, 0.4, 0.2, 0.3]),
            _logits_from_probs([0.7, 0.1, 0.1, 0.1]),
        ]
    )
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.6))
    expected = torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7], [1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-7)


def test_top_p_applied_after_temperature_and_top_k():
    # temperature 1 keeps probabilities [0.1, 0.4, 0.2, 0.3]; top_k=3 drops 0.1 -> [0, 4/9, 2/9, 3/9];
    # top_p=0.7 on that: 4/9 = 0.444 < 0.7, 4/9+3/9 = 0.778 >= 0.7 -> keep {1, 3} -> [0, 4/7, 0, 3/7]
    logits = _logits_from_probs([0.1, 0.4, 0.2, 0.3])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    torch.testing.assert_close(probs, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]), rtol=1e-5, atol=1e-7)
    # temperature 0.5 squares and renormalizes: [1, 16, 4, 9]/30; top_p=0.55: 16/30=0.533 < 0.55 -> {1, 3}
    probs = probs_from_logits(logits, SamplingParams(temperature=0.5, top_p=0.55))
    torch.testing.assert_close(probs, torch.tensor([0.0, 16 / 25, 0.0, 9 / 25]), rtol=1e-5, atol=1e-7)


def test_top_p_one_is_noop():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 7, generator=gen)
    base = probs_from_logits(logits, SamplingParams(temperature=1.1))
    assert torch.equal(probs_from_logits(logits, SamplingParams(temperature=1.1, top_p=1.0)), base)
    assert (base > 0).all()


# ----------------------------------------------------------------------------- sample


def test_sample_shape_and_support():
    gen = torch.Generator().manual_seed(5)
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]]).expand(3, 2, 4)
    tokens = sample(probs, gen)
    assert tokens.shape == (3, 2)
    assert ((tokens[:, 0] == 1) | (tokens[:, 0] == 2)).all()
    assert (tokens[:, 1] == 0).all()


def test_sample_reproducible_with_seed():
    probs = torch.softmax(torch.randn(50, 9, generator=torch.Generator().manual_seed(0)), -1)
    a = sample(probs, torch.Generator().manual_seed(7))
    b = sample(probs, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=-1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature="1.0"), "temperature"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(temperature=1.0, top_p=-0.2), "top_p"),
        (dict(temperature=1.0, top_p=float("nan")), "top_p"),
        (dict(temperature=1.0, top_k=-1), "top_k"),
        (dict(temperature=1.0, top_k=2.5), "top_k"),
        (dict(temperature=1.0, top_k=True), "top_k"),
    ],
)
def test_invalid_params_raise_spec_decode_error(kwargs, word):
    with pytest.raises(SpecDecodeError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.strip()
    assert word in message


def test_spec_decode_error_is_value_error():
    with pytest.raises(ValueError):
        SamplingParams(top_k=-1)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(temperature=0),
        dict(temperature=2),
        dict(temperature=0.5, top_k=0, top_p=1.0),
        dict(temperature=1.0, top_k=1, top_p=1e-9),
        dict(temperature=1.0, top_p=1),
    ],
)
def test_valid_params_accepted(kwargs):
    SamplingParams(**kwargs)


def test_tiny_temperature_gives_the_argmax_not_nan():
    probs = probs_from_logits(torch.tensor([1.0, 2.0, 3.0]), SamplingParams(temperature=1e-40))
    assert torch.equal(probs, torch.tensor([0.0, 0.0, 1.0]))


@pytest.mark.parametrize("kwargs", [dict(temperature=True), dict(top_p=True)])
def test_bools_are_not_numbers(kwargs):
    with pytest.raises(SpecDecodeError):
        SamplingParams(**kwargs)


def test_subnormal_temperature_and_top_p_stay_finite():
    # 5e-324 is > 0 for Python but 0 in float32: still the argmax / the top token, never nan
    logits = torch.tensor([1.0, 3.0, 2.0])
    assert torch.equal(probs_from_logits(logits, SamplingParams(temperature=5e-324)), torch.tensor([0.0, 1.0, 0.0]))
    assert torch.equal(
        probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=5e-324)), torch.tensor([0.0, 1.0, 0.0])
    )


def test_argmax_is_torchs_on_ties_nan_rows_and_dtypes():
    """sampling.argmax (numpy's on CPU float32, the verifier's greedy path) = tensor.argmax(-1).tolist()."""
    import torch

    from specdecode.sampling import argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (5, 1000), generator=g).float()  # many ties: the first index wins
    x[2, 7] = float("nan")
    x[3, 5] = float("nan")
    x[3, 9] = float("nan")  # the first NaN counts as the largest, as in torch
    x[4] = float("-inf")
    for t in (x, x[1], x.to(torch.bfloat16), x[:, ::2]):
        assert argmax(t) == t.argmax(-1).tolist()
    assert argmax(x) == [x[0].argmax().item(), x[1].argmax().item(), 7, 5, 0] and isinstance(argmax(x[1]), int)
