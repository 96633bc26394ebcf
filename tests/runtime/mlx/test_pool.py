"""The MLX pool: lazy allocation, doubling growth, explicit casts, bounds (mlx_runtime.md §1)."""
from __future__ import annotations

import re

import numpy as np
import pytest

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.runtime.cache import CacheError, Run
from mlx_pte.runtime.mlx import Pool, PoolBoundsError

H, D = 2, 3


def tokens(n: int, start: float = 0.0) -> np.ndarray:
    """[1, H, n, D] whose entries are distinct and encode their token and head."""
    a = start + np.arange(n, dtype=np.float32)[None, None, :, None] + np.zeros((1, H, n, D), np.float32)
    return a + np.arange(H, dtype=np.float32)[None, :, None, None] * 100


def write(pool: Pool, start: int, update: np.ndarray, row: int = 0) -> None:
    """Write ``update``'s tokens at consecutive slots from ``start`` of ``row``."""
    n = update.shape[2]
    slots = mx.arange(start, start + n, dtype=mx.int32)
    pool.scatter(slots, mx.array(update), start + n - 1, mx.full((n,), row, mx.int32), row)


def test_nothing_is_allocated_before_the_first_write():
    pool = Pool(H, D, mx.float32, max_slots=32, first_slots=2)
    assert (pool.rows, pool.slots) == (0, 0)


@pytest.mark.parametrize(
    "first, cap, n, expected",
    [(2, 32, 5, 8), (16, 20, 17, 20), (512, 4, 1, 4), (4, 64, 40, 64), (0, 64, 3, 4)],
)
def test_growth_doubles_and_clamps_to_max_slots(first, cap, n, expected):
    pool = Pool(H, D, mx.float32, max_slots=cap, first_slots=first)
    write(pool, 0, tokens(n))
    assert pool.slots == expected


def test_growth_preserves_existing_cells():
    pool = Pool(H, D, mx.float32, max_slots=64, first_slots=2)
    write(pool, 0, tokens(2))
    write(pool, 2, tokens(7, start=2))
    assert pool.slots == 16
    np.testing.assert_array_equal(np.array(pool.read(0, 0, 9)), tokens(9))
    np.testing.assert_array_equal(np.array(pool.read(0, 9, 7)), 0)


def test_rows_grow_by_doubling_and_keep_their_bytes():
    pool = Pool(H, D, mx.float32, max_slots=8, first_slots=4, max_rows=6)
    write(pool, 0, tokens(3), row=0)
    assert pool.rows == 1
    write(pool, 0, tokens(2, start=40), row=4)
    assert (pool.rows, pool.slots) == (6, 4)
    np.testing.assert_array_equal(np.array(pool.read(0, 0, 3)), tokens(3))
    np.testing.assert_array_equal(np.array(pool.read(4, 0, 2)), tokens(2, start=40))


def test_pool_honors_run_start():
    pool = Pool(H, D, mx.float32, max_slots=8, first_slots=8)
    write(pool, 2, tokens(3, start=10))
    np.testing.assert_array_equal(np.array(pool.read(0, 2, 3)), tokens(3, start=10))
    assert not np.array_equal(np.array(pool.read(0, 0, 3)), tokens(3, start=10))


def test_wrapped_runs_read_back_in_logical_order():
    pool = Pool(H, D, mx.float32, max_slots=5, first_slots=5)
    pool.scatter(mx.array([3, 4, 0, 1], mx.int32), mx.array(tokens(4)), 4)
    runs = (Run(3, 2), Run(0, 2))
    np.testing.assert_array_equal(np.array(pool.read_runs(0, runs)), tokens(4))


@pytest.mark.parametrize("storage", [mx.float16, mx.bfloat16])
def test_every_write_casts_to_the_storage_dtype(storage):
    pool = Pool(H, D, storage, max_slots=8, first_slots=8)
    update = mx.random.normal((1, H, 3, D), key=mx.random.key(0))
    pool.scatter(mx.array([0, 5, 1], mx.int32), update, 5)
    assert pool.data.dtype == storage
    got = pool.read(0, 0, 6)
    assert got.dtype == storage
    expected = np.array(update.astype(storage).astype(mx.float32))
    np.testing.assert_array_equal(np.array(got.astype(mx.float32))[:, :, [0, 5, 1]], expected)


def test_scatter_fills_below_and_between_live_cells():
    pool = Pool(H, D, mx.float32, max_slots=16, first_slots=2)
    write(pool, 0, tokens(4))
    pool.scatter(mx.array([6, 1], mx.int32), mx.array(tokens(2, start=50)), 6)
    assert pool.slots == 8
    want = np.zeros((1, H, 8, D), np.float32)
    want[:, :, :4] = tokens(4)
    want[:, :, 6] = tokens(1, start=50)[:, :, 0]
    want[:, :, 1] = tokens(1, start=51)[:, :, 0]
    np.testing.assert_array_equal(np.array(pool.read(0, 0, 8)), want)


def test_scatter_places_tokens_in_their_rows():
    pool = Pool(H, D, mx.float32, max_slots=8, first_slots=4, max_rows=4)
    pool.scatter(
        mx.array([0, 5, 2], mx.int32), mx.array(tokens(3)), top_slot=5,
        rows=mx.array([2, 0, 3], mx.int32), top_row=3,
    )
    assert (pool.rows, pool.slots) == (4, 8)
    want = np.zeros((4, H, 8, D), np.float32)
    for t, (row, slot) in enumerate([(2, 0), (0, 5), (3, 2)]):
        want[row, :, slot] = tokens(3)[0, :, t]
    np.testing.assert_array_equal(np.array(pool.data), want)
    np.testing.assert_array_equal(np.array(pool.window(2, 4, 3)), want[2:4, :, :3])


@pytest.mark.parametrize("layout", ["heads-contiguous", "tokens-contiguous"])
@pytest.mark.parametrize("heads_first", [True, False])
def test_both_index_orders_place_tokens_in_their_rows_whatever_the_values_layout(heads_first, layout):
    pool = Pool(H, D, mx.float32, max_slots=8, first_slots=8, max_rows=4)
    rows, slots = [2, 0, 3], [0, 5, 2]
    pool.reserve(4, 8)
    values = mx.array(tokens(3))
    if layout == "tokens-contiguous":  # [1, T, H, D] seen as [1, H, T, D], as V arrives
        values = mx.array(np.ascontiguousarray(tokens(3).transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    index = pool.scatter_index(mx.array(slots, mx.int32), mx.array(rows, mx.int32), 3, heads_first)
    pool.write(index, values, heads_first)
    want = np.zeros((4, H, 8, D), np.float32)
    for t, (row, slot) in enumerate(zip(rows, slots)):
        want[row, :, slot] = tokens(3)[0, :, t]
    np.testing.assert_array_equal(np.array(pool.data), want)


def test_a_row_prefix_copies_only_the_prefix_and_leaves_the_source():
    pool = Pool(H, D, mx.float32, max_slots=16, first_slots=8, max_rows=4)
    write(pool, 0, tokens(6), row=0)
    write(pool, 0, tokens(8, start=70), row=1)
    prefix = pool.row_prefix(0, 3)
    mx.eval(prefix)
    pool.write_prefix(1, prefix)
    np.testing.assert_array_equal(np.array(pool.read(1, 0, 3)), tokens(3))
    np.testing.assert_array_equal(np.array(pool.read(1, 3, 5)), tokens(5, start=73))
    np.testing.assert_array_equal(np.array(pool.read(0, 0, 6)), tokens(6))


def test_a_row_prefix_is_not_changed_by_later_writes_to_its_row():
    pool = Pool(H, D, mx.float32, max_slots=8, first_slots=8)
    write(pool, 0, tokens(4))
    prefix = pool.row_prefix(0, 8)  # longer than written: clipped to the pool's slots
    assert prefix.shape == (1, H, 8, D)
    write(pool, 0, tokens(4, start=9))
    np.testing.assert_array_equal(np.array(prefix)[:, :, :4], tokens(4))
    assert pool.row_prefix(1, 3) is None  # a row never written has nothing to fork


def test_a_write_never_changes_an_earlier_snapshot():
    pool = Pool(H, D, mx.float32, max_slots=8, first_slots=8)
    write(pool, 0, tokens(4))
    snapshot = pool.read(0, 0, 4)
    write(pool, 0, tokens(4, start=9))
    np.testing.assert_array_equal(np.array(snapshot), tokens(4))


@pytest.mark.parametrize(
    "act",
    [
        lambda p: write(p, 6, tokens(3)),  # past max_slots
        lambda p: write(p, 0, tokens(1), row=1),  # past max_rows
        lambda p: p.scatter(mx.array([0], mx.int32), mx.zeros((1, H + 1, 1, D)), 0),  # heads
        lambda p: p.scatter(mx.array([0, 1], mx.int32), mx.zeros((1, H, 1, D)), 1),  # count
        lambda p: p.read(0, 0, 9),
        lambda p: p.window(0, 2, 2),
    ],
)
def test_out_of_bounds_is_a_clear_error_that_changes_nothing(act):
    pool = Pool(H, D, mx.float32, max_slots=8, first_slots=2)
    write(pool, 0, tokens(2))
    before = np.array(pool.data)
    with pytest.raises(PoolBoundsError) as info:
        act(pool)
    assert isinstance(info.value, CacheError)
    np.testing.assert_array_equal(np.array(pool.data), before)


def primitives(a: mx.array, tmp_path) -> list[str]:
    """The primitive names in ``a``'s unevaluated graph (MLX's own dot export)."""
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), a)
    return re.findall(r'label ="(\w+)"', path.read_text())


def test_write_runs_places_tokens_like_a_scatter_of_their_slots():
    runs = (Run(6, 2), Run(0, 3))  # a ring's wrapped write
    update = mx.array(tokens(5, start=20))
    by_runs = Pool(H, D, mx.float32, max_slots=8, first_slots=8, max_rows=3)
    by_scatter = Pool(H, D, mx.float32, max_slots=8, first_slots=8, max_rows=3)
    for pool in (by_runs, by_scatter):
        write(pool, 0, tokens(8), row=2)
    by_runs.write_runs(2, runs, update)
    by_scatter.scatter(mx.array([6, 7, 0, 1, 2], mx.int32), update, 7, mx.full((5,), 2, mx.int32), 2)
    np.testing.assert_array_equal(np.array(by_runs.data), np.array(by_scatter.data))


def test_write_runs_is_a_static_slice_update(tmp_path):
    pool = Pool(H, D, mx.float32, max_slots=8, first_slots=8)
    write(pool, 0, tokens(3))
    mx.eval(pool.data)
    pool.write_runs(0, (Run(3, 2),), mx.array(tokens(2)))
    assert primitives(pool.data, tmp_path) == ["SliceUpdate"]


def test_write_runs_and_fork_leave_another_holder_of_the_array_untouched():
    pool = Pool(H, D, mx.float32, max_slots=8, first_slots=8, max_rows=2)
    write(pool, 0, tokens(4), row=1)
    held = pool.data  # e.g. a read in flight, or another pool's handle
    before = np.array(held)
    pool.write_runs(0, (Run(1, 2),), mx.array(tokens(2, start=50)))
    prefix = pool.row_prefix(1, 3)
    mx.eval(prefix)
    pool.write_prefix(0, prefix)
    np.testing.assert_array_equal(np.array(held), before)
    np.testing.assert_array_equal(np.array(pool.read(0, 0, 3)), tokens(3))
