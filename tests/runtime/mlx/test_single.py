"""``single`` on MLX against the oracle (mlx_runtime.md §9.1)."""
from __future__ import annotations

import numpy as np
import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.runtime.mlx import MLXSingleCache

from .helpers import bits, make_driver


def test_prefill_is_causal(sdpa_masks):
    d = make_driver("single", [0])
    assert isinstance(d.cache, MLXSingleCache)
    d.prefill(0, 0, 4)
    assert sdpa_masks == ["causal"]


def test_decode_reads_full_history_without_a_mask(sdpa_masks):
    d = make_driver("single", [0])
    d.prefill(0, 0, 4)
    d.check([0], [4])
    assert sdpa_masks[-1] is None


def test_chunked_prefill_continues_over_the_longer_history(sdpa_masks):
    d = make_driver("single", [0, 0])
    d.prefill(0, 0, 5)
    d.prefill(0, 5, 3)  # 3 queries over 8 keys: lower-right causal
    assert sdpa_masks[-2:] == ["causal", "causal"]


def test_storage_dtype_differs_casts_on_write():
    d = make_driver("single", [0], kv_dtype="float16")
    d.prefill(0, 0, 3, atol=2e-3)
    pool = d.cache._pools[0].k
    assert pool.data.dtype == mx.float16
    history = d.oracle.seqs[0][0]
    for pos in range(3):
        np.testing.assert_array_equal(
            np.array(pool.read(0, pos, 1).astype(mx.float32))[0, :, 0], history[pos][0]
        )


def test_grows_past_initial_capacity_and_keeps_earlier_cells():
    d = make_driver("single", [0], initial_capacity=2)
    d.prefill(0, 0, 2)
    assert d.cache._pools[0].k.slots == 2
    d.prefill(0, 2, 5)
    assert d.cache._pools[0].k.slots == 8
    d.check([0], [7])


def test_zero_initial_capacity_grows_on_first_write():
    d = make_driver("single", [0], initial_capacity=0)
    d.prefill(0, 0, 3)
    assert d.cache._pools[0].k.slots == 4


def test_ring_decode_evicts_oldest_and_needs_no_mask(sdpa_masks):
    d = make_driver("single", [4], max_write=1)
    for pos in range(6):
        d.check([0], [pos])
    assert sdpa_masks == [None] * 6
    assert d.cache._pools[0].k.slots == 4


def test_window_wider_than_span_stays_causal(sdpa_masks):
    d = make_driver("single", [4, 0])
    d.prefill(0, 0, 2)
    assert sdpa_masks == ["causal", "causal"]


def test_ring_step_wraps_and_rejoins_in_order(sdpa_masks):
    d = make_driver("single", [4], max_write=2)  # ring of 5 slots
    d.prefill(0, 0, 2)
    d.prefill(0, 2, 2)
    d.prefill(0, 4, 2)  # slots 4, 0: the read wraps
    assert bits(sdpa_masks[-1]) == ["11110", "01111"]


def test_gemma_like_mixed_layers_with_softcap_and_gqa():
    d = make_driver("single", [3, 0], capacity=32, max_write=3, softcap=4.0)
    for start in range(0, 12, 3):
        d.prefill(0, start, 3)
    d.check([0], [12])


def test_v_head_dim_may_differ_from_k():
    d = make_driver("single", [0, 3], v_head_dim=5, max_write=3)
    d.prefill(0, 0, 3)
    d.check([0], [3])


def test_bfloat16_model_dtype_returns_bfloat16():
    d = make_driver("single", [0], kv_dtype="bfloat16", q_dtype=mx.bfloat16)
    d.prefill(0, 0, 4, atol=2e-2)
    d.check([0], [4], atol=2e-2)


def test_rewind_then_rewrite_reads_the_new_history():
    d = make_driver("single", [0, 4], max_write=4)
    for start in (0, 4, 8):
        d.prefill(0, start, min(4, 10 - start))
    d.cache.rewind(0, 7)  # the ring still holds [6, 10), overwritten next

    d.oracle.rewind(0, 7)
    d.prefill(0, 7, 2)
    d.check([0], [9])


def test_clear_drops_every_pool():
    d = make_driver("single", [0])
    d.prefill(0, 0, 3)
    d.cache.clear()
    assert d.cache._pools[0].k.data is None
    d.oracle.remove(0)
    d.prefill(0, 0, 2)

