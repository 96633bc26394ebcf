"""One layer's K or V storage on MLX: ``[rows, H, slots, D]`` in the storage dtype.

A row is one sequence's private history (``batched-sequence`` gives each live sequence
the row of its id; ``single`` and ``batched-cell`` use row 0 only). Slots are physical
(ring modulo already applied by the planner). Keeping every sequence of a layer in one
array is what lets a batched step attend all rows at once over a view of the pool,
with no gather copy.

Invariants:
  * the pool holds nothing until its first write; after that ``0 < rows <= max_rows``
    and ``0 < slots <= max_slots``;
  * growth appends zeros (rows double from 1, slots double from ``first_slots``, each
    clamped to its cap), so a cell keeps its index and bytes;
  * every write casts to the storage dtype explicitly, so the dtype never drifts;
  * the array is replaced, never mutated in place: a handle another pool holds (or a
    read still in flight) stays a valid snapshot, and MLX donates the buffer when it is
    the only reference, so a write costs the rows written, not the pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from mlx_pte.runtime.mlx.bootstrap import mx

from mlx_pte.runtime.cache import CacheError, Run
from mlx_pte.runtime.cache.step import MAX_INDEX

STORAGE_DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
}


class PoolBoundsError(CacheError, IndexError):
    """A write or read outside what a pool may hold (a planner bug, not a user error)."""


def cast(a: mx.array, dtype: mx.Dtype) -> mx.array:
    """``a`` as ``dtype``, adding no graph node when it already is."""
    return a if a.dtype == dtype else a.astype(dtype)


def grown_size(current: int, first: int, needed: int, cap: int) -> int:
    """The size a pool axis grows to so that index ``needed - 1`` fits.

    Doubles from ``current`` (from ``first`` when nothing is allocated yet), clamped to
    ``cap``; the caller has checked ``needed <= cap``.
    """
    if needed <= current:
        return current
    size = max(current or first, 1)
    while size < needed:
        size *= 2
    return min(size, cap)


@dataclass
class Pool:
    """K or V of one layer for up to ``max_rows`` sequences.

    Args:
        heads: KV heads of the layer.
        dim: head dim of the stored tensor (K's or V's).
        dtype: storage dtype.
        max_slots: slots a row may hold (capacity for flat, ring size for rings).
        first_slots: slots of the first allocation (clamped to ``max_slots``).
        max_rows: rows the pool may hold.
    """

    heads: int
    dim: int
    dtype: mx.Dtype
    max_slots: int
    first_slots: int
    max_rows: int = 1

    def __post_init__(self) -> None:
        self.first_slots = min(self.first_slots, self.max_slots)
        self.data: Optional[mx.array] = None

    # -- shape --------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return 0 if self.data is None else self.data.shape[0]

    @property
    def slots(self) -> int:
        return 0 if self.data is None else self.data.shape[2]

    def reserve(self, rows: int, slots: int) -> None:
        """Grow to hold rows ``[0, rows)`` and slots ``[0, slots)``.

        Raises:
            PoolBoundsError: past ``max_rows`` or ``max_slots``.
        """
        if rows > self.max_rows or slots > self.max_slots:
            raise PoolBoundsError(
                f"pool holds at most {self.max_rows} rows of {self.max_slots} slots, "
                f"asked for {rows} rows and {slots} slots; the cache planner let an "
                "out-of-bounds step through, please report it"
            )
        new_rows = grown_size(self.rows, 1, rows, self.max_rows)
        new_slots = grown_size(self.slots, self.first_slots, slots, self.max_slots)
        if self.data is None:
            self.data = mx.zeros((new_rows, self.heads, new_slots, self.dim), self.dtype)
            return
        if new_slots > self.slots:
            pad = mx.zeros((self.rows, self.heads, new_slots - self.slots, self.dim), self.dtype)
            self.data = mx.concatenate([self.data, pad], axis=2)
        if new_rows > self.rows:
            pad = mx.zeros((new_rows - self.rows, self.heads, self.slots, self.dim), self.dtype)
            self.data = mx.concatenate([self.data, pad], axis=0)

    # -- reads ------------------------------------------------------------------------------
    def read(self, row: int, start: int, length: int) -> mx.array:
        """Slots ``[start, start + length)`` of ``row``: [1, H, length, D], storage dtype."""
        if row < 0 or start < 0 or row >= self.rows or start + length > self.slots:
            raise PoolBoundsError(
                f"pool read of row {row}, slots [{start}, {start + length}) is outside "
                f"the {self.rows} rows x {self.slots} slots written so far"
            )
        return self.data[row : row + 1, :, start : start + length]

    def read_runs(self, row: int, runs: Sequence[Run]) -> mx.array:
        """The slots of ``runs`` concatenated in order (oldest first)."""
        parts = [self.read(row, run.start, run.length) for run in runs]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    # -- writes -------------------------------------------------------------------------------
    def scatter(
        self,
        slots: mx.array,
        update: mx.array,
        top_slot: int,
        rows: Optional[mx.array] = None,
        top_row: int = 0,
    ) -> None:
        """Write token i of ``update`` ([1, H, T, D]) at ``(rows[i], slots[i])``.

        Args:
            slots: int32 [T], distinct per row.
            update: the tokens' K or V.
            top_slot: the largest entry of ``slots`` (host int, so growth needs no sync).
            rows: int32 [T]; None writes row 0.
            top_row: the largest entry of ``rows``.
        """
        self._check_update(update, slots.shape[0])
        self.reserve(top_row + 1, top_slot + 1)
        self.write(self.scatter_index(slots, rows, top_row), update)

    def scatter_index(
        self, slots: mx.array, rows: Optional[mx.array] = None, top_row: int = 0, heads_first: bool = False
    ) -> mx.array:
        """The flat index ``write`` takes for tokens at ``(rows[i], slots[i])``, listing
        them token by token (each token's heads together) or, with ``heads_first``, head by
        head: the order in which ``write`` reads the values (see there).

        It depends only on the pool's shape (not its dim), so the K and V pools of every
        layer with the same heads and slots share one per step. Call after ``reserve``.
        """
        rows_, heads, slots_, _ = self.data.shape
        # Flatten to [rows*H*slots, D] so one scatter along axis 0 places every
        # (row, head, slot); a reshape of the contiguous pool is free.
        wide = rows_ * heads * slots_ > MAX_INDEX  # int32 indices would overflow
        itype = mx.int64 if wide else mx.int32
        where = cast(slots, itype)
        if rows is not None and top_row > 0:  # rows all 0 add nothing
            where = where + cast(rows, itype) * (heads * slots_)
        head_base = mx.arange(heads, dtype=itype) * slots_
        base = head_base[:, None] + where[None, :] if heads_first else where[:, None] + head_base[None, :]
        return base.reshape(-1, 1)

    def write(self, index: mx.array, update: mx.array, heads_first: bool = False) -> None:
        """Write ``update`` ([1, H, T, D]) at ``index`` (``scatter_index`` of its tokens, in
        the same order).

        The scatter reads the values as rows of ``[T*H, D]`` (tokens first) or ``[H*T, D]``
        (heads first); that reshape is free only where it matches how ``update`` is laid
        out, and otherwise copies it. RoPE's output (K) is contiguous as ``[1, H, T, D]``:
        heads first; a projection seen through a transpose (V) is contiguous as
        ``[1, T, H, D]``: tokens first (``bench/kv_write.py``: one copy kernel per
        mismatched write on the H200).
        """
        tokens = index.shape[0] // self.heads
        self._check_update(update, tokens)
        rows_, heads, slots_, dim = self.data.shape
        # squeeze, not [0]: an integer index is a gather in MLX, a squeeze a view.
        values = cast(update, self.dtype).squeeze(0)
        values = values if heads_first else values.transpose(1, 0, 2)
        values = values.reshape(tokens * heads, dim)
        flat = self.data.reshape(rows_ * heads * slots_, dim)
        self.data = mx.put_along_axis(flat, index, values, axis=0).reshape(rows_, heads, slots_, dim)

    def write_runs(self, row: int, runs: Sequence[Run], update: mx.array) -> None:
        """Write ``update``'s tokens ([1, H, T, D]) in order over the slot ``runs`` of ``row``.

        One static slice write per run (a step of one sequence has 1-2 runs): the row and
        slots are host ints, so each lowers to a plain ``SliceUpdate`` (no offset array, no
        dynamic-offset kernel), fewer and cheaper ops than the flat scatter.
        """
        self._check_update(update, sum(run.length for run in runs))
        self.reserve(row + 1, max(run.start + run.length for run in runs))
        update = cast(update, self.dtype)
        offset = 0
        for run in runs:
            part = update if len(runs) == 1 else update[:, :, offset : offset + run.length]
            self._set(row, run.start, part)
            offset += run.length

    def _set(self, row: int, start: int, part: mx.array) -> None:
        """Replace ``self.data`` by a copy with ``part`` ([1, H, L, D]) at ``(row, start)``.

        Item assignment with Python slices is MLX's static slice update, but it rebinds
        the handle it is called on; ``data[...]`` is a new handle to the same array (no
        graph node), so any other holder of the old handle keeps its snapshot.
        """
        fresh = self.data[...]
        fresh[row : row + 1, :, start : start + part.shape[2]] = part
        self.data = fresh

    def _check_update(self, update: mx.array, tokens: int) -> None:
        shape = tuple(update.shape)
        if shape != (1, self.heads, tokens, self.dim):
            raise PoolBoundsError(
                f"pool update must be [1, {self.heads}, {tokens}, {self.dim}], got {shape}"
            )

    # -- whole rows ---------------------------------------------------------------------------
    def window(self, lo: int, hi: int, length: int) -> mx.array:
        """Rows ``[lo, hi)``, slots ``[0, length)``: a view, [hi - lo, H, length, D]."""
        if lo < 0 or hi > self.rows or length > self.slots:
            raise PoolBoundsError(
                f"pool window of rows [{lo}, {hi}), {length} slots is outside the "
                f"{self.rows} rows x {self.slots} slots written so far"
            )
        return self.data[lo:hi, :, :length]

    def row_prefix(self, row: int, length: int) -> Optional[mx.array]:
        """A copy of slots ``[0, length)`` of ``row`` ([1, H, length, D]) in a buffer of
        its own, unevaluated; None when the row was never written (nothing to fork).

        A slice alone would be a view of the pool's buffer: written back into the pool,
        it keeps that buffer shared, so the write cannot reuse it and copies the whole
        pool. ``mx.array`` copies; the caller evaluates the copies (all layers at once)
        before it writes them (``write_prefix``).
        """
        if self.data is None or row >= self.rows:
            return None
        return mx.array(self.data[row : row + 1, :, : min(length, self.slots)])

    def write_prefix(self, row: int, prefix: mx.array) -> None:
        """Write ``prefix`` ([1, H, L, D], a ``row_prefix``) over slots ``[0, L)`` of ``row``."""
        self._check_update(prefix, prefix.shape[2])
        self.reserve(row + 1, prefix.shape[2])
        self._set(row, 0, prefix)


@dataclass
class LayerPools:
    """The K and V pools of one layer."""

    k: Pool
    v: Pool

    def write(self, k: mx.array, v: mx.array, index: Callable[[bool], mx.array]) -> None:
        """Write a step's K and V, each through ``index(heads_first)`` (the caller's
        ``scatter_index`` of the step's tokens, shared by the layers): K heads first, V
        tokens first, each in the order its values lie (``Pool.write``)."""
        for pool, values, heads_first in ((self.k, k, True), (self.v, v, False)):
            pool.write(index(heads_first), values, heads_first)


def layer_pools(
    heads: int,
    head_dim: int,
    v_head_dim: int,
    dtype: mx.Dtype,
    max_slots: int,
    first_slots: int,
    max_rows: int = 1,
) -> LayerPools:
    """Empty K and V pools of one layer with the same row and slot limits."""
    return LayerPools(
        Pool(heads, head_dim, dtype, max_slots, first_slots, max_rows),
        Pool(heads, v_head_dim, dtype, max_slots, first_slots, max_rows),
    )
