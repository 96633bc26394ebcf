"""Device sampling against the host reference sampler (numpy, ``sampling.Sampler``).

Every draw is seeded, so the chi-square tests are deterministic: they cannot flake.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scipy.stats import chisquare

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.serving.sampling.device import TokenStream, draw
from mlx_pte.serving.sampling.params import Sampler, SamplingParams

ROW = np.array([2.0, 1.5, 1.4, 0.3, 0.0, -0.2, -0.7, -1.0, -1.6, -2.5, -3.0, -4.0])
FILTERS = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.5, top_k=5),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.8, top_k=7, top_p=0.9),
]


def streams(count: int, first_seed: int = 0, **kwargs) -> list[TokenStream]:
    return [TokenStream.start(SamplingParams(seed=first_seed + i, **kwargs)) for i in range(count)]


def assert_matches_reference(draws: np.ndarray, kwargs: dict) -> None:
    want = Sampler(SamplingParams(**kwargs)).probabilities(ROW)
    counts = np.bincount(draws, minlength=len(ROW))
    support = want > 0
    assert counts[~support].sum() == 0, "drew a token the filters exclude"
    result = chisquare(counts[support], want[support] * len(draws))
    assert result.pvalue > 1e-3, (counts, want * len(draws))


@pytest.mark.parametrize("kwargs", FILTERS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_draws_across_seeds_follow_the_reference_distribution(kwargs):
    count = 20000
    logits = mx.array(ROW[None].astype(np.float32))
    draws = np.array(draw(logits, streams(count, **kwargs), rows=[0] * count))
    assert_matches_reference(draws, kwargs)


@pytest.mark.parametrize("kwargs", FILTERS[::2], ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_one_stream_key_chain_follows_the_reference_distribution(kwargs):
    # The same seed, one draw per step: each split gives a fresh, independent draw.
    logits = mx.array(ROW[None].astype(np.float32))
    (stream,) = streams(1, first_seed=5, **kwargs)
    draws = []
    for _ in range(1500):
        token = draw(logits, [stream])
        draws.append(token)
        mx.async_eval(stream.key)
    assert_matches_reference(np.array(mx.concatenate(draws)), kwargs)


def test_greedy_is_argmax_first_on_ties():
    rng = np.random.default_rng(0)
    # Rounded to few values so that rows have tied maxima.
    rows = np.round(rng.normal(size=(64, 300)), 1).astype(np.float32)
    params = [SamplingParams(), SamplingParams(temperature=1e-6, top_k=3, seed=1)]
    got = np.array(draw(mx.array(rows), [TokenStream.start(params[i % 2]) for i in range(64)]))
    np.testing.assert_array_equal(got, np.argmax(rows, axis=-1))


def test_a_seed_repeats_whatever_shares_the_batch():
    rng = np.random.default_rng(1)
    logits = mx.array(rng.normal(size=(4, 500)).astype(np.float32))
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11)

    def run(batched: bool) -> list[int]:
        (mine,) = [TokenStream.start(params)]
        others = [TokenStream.start(SamplingParams()), TokenStream.start(SamplingParams(temperature=2.0, seed=3))]
        tokens = []
        for _ in range(30):
            if batched:
                ids = draw(logits, [others[0], mine, others[1]], rows=[0, 2, 3])
                tokens.append(int(ids[1].item()))
            else:
                tokens.append(int(draw(logits[2:3], [mine]).item()))
        return tokens

    alone = run(batched=False)
    assert alone == run(batched=False) == run(batched=True)
    other_seed = TokenStream.start(SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=12))
    assert [int(draw(logits[2:3], [other_seed]).item()) for _ in range(30)] != alone


def allowed(row: np.ndarray, params: SamplingParams) -> set[int]:
    """Tokens the reference may pick, a hair wider than its top-p (float32 on the device),
    and with every token tied to a kept one (the device keeps ties, the reference breaks them)."""
    wider = SamplingParams(params.temperature, params.top_k, min(1.0, params.top_p + 1e-4))
    kept = Sampler(wider).probabilities(row) > 0
    return set(np.flatnonzero(row >= row[kept].min()).tolist())


@settings(max_examples=150, deadline=None)
@given(
    row=st.lists(st.floats(-8, 8, allow_nan=False), min_size=2, max_size=40),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 40),
    top_p=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**32),
)
def test_top_k_and_top_p_never_pick_outside_the_allowed_set(row, temperature, top_k, top_p, seed):
    row = np.round(np.array(row), 3)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    count = 64
    logits = mx.array(row[None].astype(np.float32))
    got = set(np.array(draw(logits, streams(count, first_seed=seed, temperature=temperature,
                                               top_k=top_k, top_p=top_p), rows=[0] * count)).tolist())
    assert got <= allowed(row, params)
