"""Bad attend calls raise typed errors before anything is written."""
from __future__ import annotations

import numpy as np
import pytest

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.runtime.cache import AttendError, Step, StepStateError

from .helpers import HEAD_DIM, KV_HEADS, Q_HEADS, make_driver

KINDS = ["single", "batched-cell", "batched-sequence"]


def qkv(tokens: int, q_heads=Q_HEADS, kv_heads=KV_HEADS, dim=HEAD_DIM, v_dim=HEAD_DIM, dtype=mx.float32):
    return (
        mx.zeros((1, q_heads, tokens, dim), dtype),
        mx.zeros((1, kv_heads, tokens, dim), dtype),
        mx.zeros((1, kv_heads, tokens, v_dim), dtype),
    )


def pool_bytes(cache) -> list:
    return [None if p.k.data is None else np.array(p.k.data) for p in cache._pools]


def started(kind: str):
    """A driver whose sequence holds 2 positions on both layers (flat, ring 2)."""
    d = make_driver(kind, [0, 2], max_write=2)
    seq = d.cache.seq_new()
    d.prefill(seq, 0, 2)
    return d, seq


@pytest.mark.parametrize("kind", KINDS)
def test_attend_without_a_declared_step_is_a_state_error(kind):
    d, _ = started(kind)
    before = pool_bytes(d.cache)
    with pytest.raises(StepStateError, match="declare_step"):
        d.cache.attend(0, *qkv(1), 1.0)
    assert all(np.array_equal(a, b) for a, b in zip(pool_bytes(d.cache), before))


BAD_CALLS = {
    "unknown layer": (2, qkv(1)),
    "negative layer": (-1, qkv(1)),
    "bool layer": (True, qkv(1)),
    "tokens differ from the step": (0, qkv(2)),
    "k heads": (0, qkv(1, kv_heads=1, q_heads=4)),
    "q heads not a multiple": (0, qkv(1, q_heads=3)),
    "head dim": (0, qkv(1, dim=4)),
    "v head dim": (0, qkv(1, v_dim=4)),
    "dtype mismatch": (0, (mx.zeros((1, 4, 1, 8)), mx.zeros((1, 2, 1, 8), mx.float16), mx.zeros((1, 2, 1, 8)))),
    "3-d q": (0, (mx.zeros((4, 1, 8)), *qkv(1)[1:])),
    "batch of 2": (0, (mx.zeros((2, 4, 1, 8)), *qkv(1)[1:])),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_is_refused_and_changes_nothing(kind, case):
    d, seq = started(kind)
    d.cache.declare_step(Step((seq,), (2,)))
    before = pool_bytes(d.cache)
    layer, (q, k, v) = BAD_CALLS[case]
    with pytest.raises(AttendError):
        d.cache.attend(layer, q, k, v, 1.0)
    assert all(np.array_equal(a, b) for a, b in zip(pool_bytes(d.cache), before))
    # The declared step still stands and a good forward still matches the oracle.
    d.cache.abort_step()
    d.check([seq], [2])


@pytest.mark.parametrize("kind", KINDS)
def test_negative_softcap_is_refused(kind):
    d, seq = started(kind)
    d.cache.declare_step(Step((seq,), (2,)))
    with pytest.raises(AttendError, match="softcap"):
        d.cache.attend(0, *qkv(1), 1.0, -1.0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_layer_repeated_with_the_same_tokens_is_idempotent(kind):
    d, seq = started(kind)
    d.cache.declare_step(Step((seq,), (2,)))
    rng = np.random.default_rng(3)
    q, k, v = (mx.array(rng.standard_normal(a.shape, np.float32)) for a in qkv(1))
    first = np.array(d.cache.attend(0, q, k, v, 0.5))
    again = np.array(d.cache.attend(0, q, k, v, 0.5))
    np.testing.assert_array_equal(first, again)
    d.cache.finish_step()
    assert d.cache.pos(*(() if kind == "single" else (seq,))) == 3
