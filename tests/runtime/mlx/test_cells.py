"""``batched-cell`` on MLX against the oracle (mlx_runtime.md §9.2)."""
from __future__ import annotations

import numpy as np

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.runtime.cache import CACHE_FACTORY, CacheControl
from mlx_pte.runtime.mlx import MLXCellCache

from .helpers import bits, make_driver


def test_prefill_claims_cells_in_order_behind_a_causal_mask(sdpa_masks):
    d = make_driver("batched-cell", [0])
    a = d.cache.seq_new()
    d.prefill(a, 0, 4)
    assert bits(sdpa_masks[0]) == ["1000", "1100", "1110", "1111"]
    history = d.oracle.seqs[a][0]
    got = np.array(d.cache._pools[0].k.read(0, 0, 4))
    np.testing.assert_array_equal(got[0].transpose(1, 0, 2), np.stack([history[p][0] for p in range(4)]))


def test_decode_extends_the_window(sdpa_masks):
    d = make_driver("batched-cell", [0])
    a = d.cache.seq_new()
    d.prefill(a, 0, 2)
    d.check([a], [2])
    assert bits(sdpa_masks[-1]) == ["111"]


def test_mask_isolates_sequences(sdpa_masks):
    d = make_driver("batched-cell", [0])
    a, b = d.cache.seq_new(), d.cache.seq_new()
    d.check([a, a, b, b], [0, 1, 0, 1])
    d.check([b], [2])
    assert bits(sdpa_masks[-1]) == ["00111"]


def test_freed_cells_refill_below_live_ones(sdpa_masks):
    d = make_driver("batched-cell", [0])
    a, b = d.cache.seq_new(), d.cache.seq_new()
    d.prefill(a, 0, 3)
    d.check([b], [0])
    d.cache.seq_rm(a)
    d.oracle.remove(a)
    assert d.cache.used_end() == 4
    d.check([b], [1])
    assert bits(sdpa_masks[-1]) == ["1001"]


def test_window_hides_older_cells(sdpa_masks):
    d = make_driver("batched-cell", [0, 2])
    a = d.cache.seq_new()
    d.prefill(a, 0, 3)
    d.check([a], [3])
    assert bits(sdpa_masks[-2]) == ["1111"]
    assert bits(sdpa_masks[-1]) == ["0011"]


def test_growth_preserves_existing_cells():
    d = make_driver("batched-cell", [0], initial_capacity=2)
    a, b = d.cache.seq_new(), d.cache.seq_new()
    d.check([a, b], [0, 0])
    assert d.cache._pools[0].k.slots == 2
    d.prefill(a, 1, 4)
    assert d.cache._pools[0].k.slots == 8
    d.check([b, a], [1, 5])


def test_storage_dtype_differs_casts_on_write():
    d = make_driver("batched-cell", [0, 3], kv_dtype="bfloat16")
    a = d.cache.seq_new()
    d.prefill(a, 0, 4, atol=2e-2)
    assert d.cache._pools[1].v.data.dtype == mx.bfloat16


def test_forks_share_cells_and_diverge():
    d = make_driver("batched-cell", [0, 2])
    a = d.cache.seq_new()
    d.prefill(a, 0, 5)
    f = d.cache.seq_clone(a, 3)
    d.oracle.fork(a, f, 3)
    d.check([a, f], [5, 3])
    d.check([f, a], [4, 6])


def test_positions_with_gaps_and_softcap():
    d = make_driver("batched-cell", [0, 3], softcap=3.0)
    a, b = d.cache.seq_new(), d.cache.seq_new()
    d.check([a, a, b], [0, 4, 2])
    d.check([b, a], [9, 5])


def test_registry_builds_the_cell_layout():
    d = make_driver("batched-cell", [0])
    assert isinstance(d.cache, MLXCellCache)
    assert isinstance(d.cache, CacheControl)
    assert "batched-cell" in CACHE_FACTORY.kinds("mlx")
