"""Sampling filters against a brute-force restatement of their definitions."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mlx_pte.serving.sampling.params import GREEDY_TEMPERATURE, MAX_SEED, Sampler, SamplingError, SamplingParams


def brute_force(row, temperature, top_k, top_p):
    """softmax(row/T) over the top-k tokens, then the smallest top-p nucleus (by rank)."""
    n = len(row)
    ranked = sorted(range(n), key=lambda i: (-row[i], i))
    allowed = set(ranked[:top_k]) if top_k else set(range(n))
    # top-k keeps ties with the k-th value as well
    if top_k:
        kth = row[ranked[top_k - 1]]
        allowed = {i for i in range(n) if row[i] >= kth}
    z = max(row[i] for i in allowed) / temperature
    weights = {i: np.exp(row[i] / temperature - z) for i in allowed}
    total = sum(weights.values())
    probs = {i: w / total for i, w in weights.items()}
    if top_p < 1.0:
        kept, mass = [], 0.0
        for i in sorted(probs, key=lambda i: (-probs[i], i)):
            kept.append(i)
            mass += probs[i]
            if mass >= top_p:
                break
        total = sum(probs[i] for i in kept)
        probs = {i: probs[i] / total for i in kept}
    out = np.zeros(n)
    for i, p in probs.items():
        out[i] = p
    return out


@settings(max_examples=200, deadline=None)
@given(
    row=st.lists(st.floats(-8, 8, allow_nan=False), min_size=2, max_size=12),
    temperature=st.floats(0.2, 3.0),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.05, 1.0),
)
def test_filters_match_their_definition(row, temperature, top_k, top_p):
    row = np.round(np.array(row), 3)
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    got = sampler.probabilities(row.astype(np.float64))
    want = brute_force(list(row), temperature, min(top_k, len(row)) if top_k else 0, top_p)
    # Ties at the nucleus boundary may be broken either way; the kept mass must agree.
    np.testing.assert_allclose(got.sum(), 1.0, atol=1e-9)
    np.testing.assert_allclose(np.sort(got), np.sort(want), atol=1e-9)


def test_greedy_is_argmax_and_first_on_ties():
    row = np.array([0.1, 3.0, 3.0, -1.0])
    assert Sampler(SamplingParams())(row) == 1


def test_draws_follow_the_distribution_and_repeat_per_seed():
    row = np.log(np.array([0.5, 0.3, 0.2]))
    params = SamplingParams(temperature=1.0, seed=7)
    draws = [Sampler(params)(row) for _ in range(1)]
    first = Sampler(params)
    seq_a = [first(row) for _ in range(4000)]
    second = Sampler(params)
    seq_b = [second(row) for _ in range(4000)]
    assert seq_a == seq_b and draws[0] == seq_a[0]
    freq = np.bincount(seq_a, minlength=3) / len(seq_a)
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.2], atol=0.03)
    other = Sampler(SamplingParams(temperature=1.0, seed=8))
    assert [other(row) for _ in range(50)] != seq_a[:50]


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=1.5)]
)
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(SamplingError):
        SamplingParams(**kwargs)


@settings(max_examples=300, deadline=None)
@given(
    row=st.lists(st.floats(-1e308, 1e308, allow_nan=False, allow_infinity=False), min_size=1, max_size=16),
    temperature=st.one_of(st.floats(0.0, 1e308, allow_nan=False), st.sampled_from([5e-324, 1e-320, 1e-6])),
    top_k=st.integers(0, 20),
    top_p=st.one_of(st.floats(5e-324, 1.0, exclude_min=False), st.just(1.0)),
)
def test_every_accepted_parameter_gives_a_distribution(row, temperature, top_k, top_p):
    row = np.array(row)
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=0))
    token = sampler(row)
    assert 0 <= token < len(row)
    if temperature < GREEDY_TEMPERATURE:  # greedy: the first best logit
        assert token == int(np.argmax(row))
    else:
        probs = sampler.probabilities(row)
        assert np.isfinite(probs).all() and probs.min() >= 0
        np.testing.assert_allclose(probs.sum(), 1.0, atol=1e-9)
        assert probs[np.argmax(row)] == probs.max()  # the best token is never filtered out


@pytest.mark.parametrize("kwargs", [
    dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=float("nan")),
    dict(seed=-1), dict(seed=2**63), dict(seed=1.5), dict(seed=True),
])
def test_non_finite_and_out_of_range_parameters_are_refused(kwargs):
    with pytest.raises(SamplingError):
        SamplingParams(**kwargs)


def test_seed_bounds_are_accepted():
    for seed in (0, MAX_SEED):
        Sampler(SamplingParams(temperature=1.0, seed=seed))(np.zeros(4))


def test_non_finite_logits_are_a_sampling_error():
    with pytest.raises(SamplingError, match="inf or NaN"):
        Sampler(SamplingParams(temperature=1.0))(np.array([0.0, np.nan]))
