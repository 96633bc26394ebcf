"""The MLX pool: lazy allocation, doubling growth, explicit casts, bounds (mlx_runtime.md §1)."""
from __future__ import annotations

import numpy as np
import pytest

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.runtime.cache import CacheError, Run
from mlx_pte.runtime.mlx import Pool, PoolBoundsError

H, D = 2, 3


def tokens(n: int, start: float = 0.0, rows: int = 1) -> mx.array:
    """[1, H, n, D] whose entries are distinct and encode their token index."""
    a = start + np.arange(n, dtype=np.float32)[None, None, :, None] + np.zeros((1, H, n, D), np.float32)
    return mx.array(a + np.arange(H, dtype=np.float32)[None, :, None, None] * 100)


def test_nothing_is_allocated_before_the_first_write():
    pool = Pool(H, D, mx.float32, max_slots=32, first_slots=2)
    assert (pool.rows, pool.slots) == (0, 0)


@pytest.mark.parametrize(
    "first, cap, write, expected",
    [(2, 32, 5, 8), (16, 20, 17, 20), (512, 4, 1, 4), (4, 64, 40, 64), (0, 64, 3, 4)],
)
def test_growth_doubles_and_clamps_to_max_slots(first, cap, write, expected):
    pool = Pool(H, D, mx.float32, max_slots=cap, first_slots=first)
    pool.write(0, 0, tokens(write))
    assert pool.slots == expected


def test_growth_preserves_existing_cells():
    pool = Pool(H, D, mx.float32, max_slots=64, first_slots=2)
    pool.write(0, 0, tokens(2))
    pool.write(0, 2, tokens(7, start=2))
    assert pool.slots == 16
    np.testing.assert_array_equal(np.array(pool.read(0, 0, 9)), np.array(tokens(9)))
    np.testing.assert_array_equal(np.array(pool.read(0, 9, 7)), 0)


def test_pool_honors_run_start():
    pool = Pool(H, D, mx.float32, max_slots=8, first_slots=8)
    pool.write(0, 2, tokens(3, start=10))
    np.testing.assert_array_equal(np.array(pool.read(0, 2, 3)), np.array(tokens(3, start=10)))
    assert not np.array_equal(np.array(pool.read(0, 0, 3)), np.array(tokens(3, start=10)))


def test_runs_write_and_read_in_logical_order():
    pool = Pool(H, D, mx.float32, max_slots=5, first_slots=5)
    runs = (Run(3, 2), Run(0, 2))  # a wrapped ring step: logical tokens 0,1 then 2,3
    pool.write_runs(0, runs, tokens(4))
    np.testing.assert_array_equal(np.array(pool.read_runs(0, runs)), np.array(tokens(4)))
    np.testing.assert_array_equal(np.array(pool.read(0, 3, 2)), np.array(tokens(2)))


@pytest.mark.parametrize("storage", [mx.float16, mx.bfloat16])
def test_every_write_casts_to_the_storage_dtype(storage):
    pool = Pool(H, D, storage, max_slots=8, first_slots=8)
    update = mx.random.normal((1, H, 3, D), key=mx.random.key(0))
    pool.write(0, 0, update[:, :, :2])
    pool.write_cells(mx.array([5], mx.int32), update[:, :, 2:], top_cell=5)
    assert pool.data.dtype == storage
    expected = np.array(update.astype(storage).astype(mx.float32))
    got = pool.read(0, 0, 6)
    assert got.dtype == storage
    np.testing.assert_array_equal(np.array(got[:, :, :2].astype(mx.float32)), expected[:, :, :2])
    np.testing.assert_array_equal(np.array(got[:, :, 5:].astype(mx.float32)), expected[:, :, 2:])


def test_write_cells_scatters_below_and_between_live_cells():
    pool = Pool(H, D, mx.float32, max_slots=16, first_slots=2)
    pool.write(0, 0, tokens(4))
    pool.write_cells(mx.array([6, 1], mx.int32), tokens(2, start=50), top_cell=6)
    assert pool.slots == 8
    got = np.array(pool.read(0, 0, 8))
    want = np.zeros((1, H, 8, D), np.float32)
    want[:, :, :4] = np.array(tokens(4))
    want[:, :, 6] = np.array(tokens(1, start=50))[:, :, 0]
    want[:, :, 1] = np.array(tokens(1, start=51))[:, :, 0]
    np.testing.assert_array_equal(got, want)


def test_scatter_places_tokens_in_their_rows():
    pool = Pool(H, D, mx.float32, max_slots=8, first_slots=4, max_rows=4)
    pool.scatter(
        mx.array([0, 5, 2], mx.int32), tokens(3), top_slot=5,
        rows=mx.array([2, 0, 3], mx.int32), top_row=3,
    )
    assert (pool.rows, pool.slots) == (4, 8)
    data = np.array(pool.data)
    want = np.zeros_like(data)
    for t, (row, slot) in enumerate([(2, 0), (0, 5), (3, 2)]):
        want[row, :, slot] = np.array(tokens(3))[0, :, t]
    np.testing.assert_array_equal(data, want)


def test_fork_row_copies_only_the_prefix_and_leaves_the_source():
    pool = Pool(H, D, mx.float32, max_slots=16, first_slots=8, max_rows=4)
    pool.write(0, 0, tokens(6))
    pool.write(1, 0, tokens(8, start=70))
    pool.fork_row(0, 1, 3)
    np.testing.assert_array_equal(np.array(pool.read(1, 0, 3)), np.array(tokens(3)))
    np.testing.assert_array_equal(np.array(pool.read(1, 3, 5)), np.array(tokens(5, start=73)))
    np.testing.assert_array_equal(np.array(pool.read(0, 0, 6)), np.array(tokens(6)))


def test_a_write_never_changes_an_earlier_snapshot():
    pool = Pool(H, D, mx.float32, max_slots=8, first_slots=8)
    pool.write(0, 0, tokens(4))
    snapshot = pool.read(0, 0, 4)
    pool.write(0, 0, tokens(4, start=9))
    np.testing.assert_array_equal(np.array(snapshot), np.array(tokens(4)))


@pytest.mark.parametrize(
    "act",
    [
        lambda p: p.write(0, 6, tokens(3)),  # past max_slots
        lambda p: p.write(0, -1, tokens(1)),
        lambda p: p.write(1, 0, tokens(1)),  # past max_rows
        lambda p: p.write_cells(mx.array([8], mx.int32), tokens(1), top_cell=8),
        lambda p: p.write(0, 0, mx.zeros((1, H + 1, 1, D))),  # wrong heads
        lambda p: p.read(0, 0, 9),
    ],
)
def test_out_of_bounds_is_a_clear_error_that_changes_nothing(act):
    pool = Pool(H, D, mx.float32, max_slots=8, first_slots=2)
    pool.write(0, 0, tokens(2))
    before = np.array(pool.data)
    with pytest.raises(PoolBoundsError) as info:
        act(pool)
    assert isinstance(info.value, CacheError)
    np.testing.assert_array_equal(np.array(pool.data), before)
