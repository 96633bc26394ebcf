"""Device log-probabilities against numpy's log-softmax of the same rows."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx

from mlx_pte.serving.sampling.logprobs import logprob_arrays, read


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    rows = rows.astype(np.float64)
    shifted = rows - rows.max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(2, 64), k=st.integers(0, 20), masked=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_logprobs_are_the_log_softmax_of_the_rows_and_the_top_k_its_largest(rows, vocab, k, masked, seed):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    if masked:  # a grammar's forbidden tokens: -inf, never in the top unless nothing else is left
        logits[rng.random((rows, vocab)) < 0.5] = -np.inf
        logits[np.arange(rows), rng.integers(0, vocab, rows)] = 1.0
    tokens = np.array([rng.choice(np.flatnonzero(np.isfinite(r))) for r in logits])
    expected = _log_softmax(logits)
    got = read(tokens.tolist(), logprob_arrays(mx.array(logits), mx.array(tokens), k), [k] * rows)
    for r, record in enumerate(got):
        assert record.token == tokens[r]
        np.testing.assert_allclose(record.logprob, expected[r, tokens[r]], rtol=1e-5, atol=1e-5)
        assert len(record.top) == min(k, vocab)
        values = [v for _, v in record.top]
        assert values == sorted(values, reverse=True)
        for token, value in record.top:
            np.testing.assert_allclose(value, expected[r, token], rtol=1e-5, atol=1e-5)
        if record.top:  # the k largest: nothing left out beats the smallest kept
            left_out = np.delete(expected[r], [t for t, _ in record.top])
            assert (left_out <= values[-1] + 1e-6).all()


def test_each_draw_keeps_its_own_number_of_top_tokens():
    logits = mx.array(np.log(np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=np.float32)))
    first, second = read([0, 2], logprob_arrays(logits, mx.array([0, 2]), 2), [2, 0])
    assert [t for t, _ in first.top] == [0, 1] and second.top == ()
    np.testing.assert_allclose([first.logprob, second.logprob], np.log([0.5, 0.8]), rtol=1e-6)
