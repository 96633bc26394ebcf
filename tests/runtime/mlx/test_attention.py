"""Masks and the attention kernel against brute force (mlx_runtime.md §2, §3.4)."""
from __future__ import annotations

import numpy as np
import pytest

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.runtime.mlx import attend, lower_right_mask

from .helpers import bits
from .oracle import full_attention


def test_window_causal_mask_is_a_band():
    assert bits(lower_right_mask(3, 5, 3)) == ["11100", "01110", "00111"]


def test_a_window_covering_the_span_is_plain_lower_right_causal():
    assert bits(lower_right_mask(3, 5, 5)) == ["11100", "11110", "11111"]
    assert bits(lower_right_mask(3, 5)) == ["11100", "11110", "11111"]


def test_ring_wrap_band():
    assert bits(lower_right_mask(2, 5, 4)) == ["11110", "01111"]


def brute(q, k, v, scale, softcap, allowed):
    """[1, Hq, T, Dv] by full attention of each query over its allowed keys."""
    out = np.zeros(q.shape[:3] + (v.shape[3],))
    for t in range(q.shape[2]):
        keys = [j for j in range(k.shape[2]) if allowed[t, j]]
        out[0, :, t] = full_attention(
            q[0, :, t], k[0][:, keys].transpose(1, 0, 2), v[0][:, keys].transpose(1, 0, 2), scale, softcap
        )
    return out


@pytest.mark.parametrize("softcap", [0.0, 2.5])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "band"])
@pytest.mark.parametrize("v_dim", [8, 5])
def test_attend_matches_brute_force(softcap, mask_kind, v_dim):
    rng = np.random.default_rng(1)
    T, S = 3, 6
    q = rng.standard_normal((1, 6, T, 8), np.float32) * 2
    k = rng.standard_normal((1, 2, S, 8), np.float32) * 2
    v = rng.standard_normal((1, 2, S, v_dim), np.float32)
    offset = np.arange(S)[None, :] - np.arange(T)[:, None]
    allowed = {
        "none": np.ones((T, S), bool),
        "causal": offset <= S - T,
        "band": (offset <= S - T) & (offset >= S - T - 2 + 1),
    }[mask_kind]
    mask = {"none": None, "causal": "causal", "band": lower_right_mask(T, S, 2)}[mask_kind]
    got = attend(mx.array(q), mx.array(k), mx.array(v), 0.4, softcap, mask)
    assert got.dtype == mx.float32 and got.shape == (1, 6, T, v_dim)
    np.testing.assert_allclose(np.array(got), brute(q, k, v, 0.4, softcap, allowed), atol=1e-5)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_output_keeps_the_query_dtype(dtype):
    rng = np.random.default_rng(2)
    q = mx.array(rng.standard_normal((1, 4, 2, 8), np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((1, 2, 5, 8), np.float32)).astype(dtype)
    got = attend(q, k, k, 0.3, 0.0, "causal")
    assert got.dtype == dtype
    as32 = [np.array(a.astype(mx.float32)) for a in (q, k)]
    allowed = np.arange(5)[None, :] <= np.arange(2)[:, None] + 3
    want = brute(as32[0], as32[1], as32[1], 0.3, 0.0, allowed)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, atol=2e-2)


def test_a_fully_masked_softcapped_query_stays_finite():
    q = mx.ones((2, 2, 1, 4))
    k = mx.ones((2, 2, 3, 4))
    mask = mx.array([[[[True, False, False]]], [[[False, False, False]]]])
    assert np.isfinite(np.array(attend(q, k, k, 1.0, 3.0, mask))).all()
