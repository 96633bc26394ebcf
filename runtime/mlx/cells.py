"""``batched-cell`` on MLX: one pool of cells per layer, shared by every sequence.

Token i's K/V land in cell ``plan.cells[i]`` (a scatter: freed cells refill below live
ones); every query reads cells ``[0, read_len)`` and an explicit mask, built on device
from each cell's position and owners, isolates sequences and applies windows. A window
only narrows the mask, so every layer spans the whole cell table. The mask is never the
fused causal one, even for decode: a cell's neighbours may belong to other sequences.
"""
from __future__ import annotations

from typing import Optional

from mlx_pte.runtime.mlx.bootstrap import mx

from mlx_pte.runtime.cache import CacheConfig, CacheGeometry, CellCache, CellStepPlan

from .attention import attend
from mlx_pte.runtime.cache.attend_checks import check_attend
from .masks import StepMemo, visible
from .pool import STORAGE_DTYPES, LayerPools, layer_pools


def cell_mask(plan: CellStepPlan, window: int, memo: StepMemo) -> mx.array:
    """bool [1, 1, T, read_len]: token i sees cell j iff its sequence owns j and j's
    position is visible from token i's (see ``masks.visible``).

    The cell table is uploaded once per step (shared by every window).
    """
    key_pos, owned, query_seq, query_pos = memo.get(
        plan,
        "table",
        lambda: (
            mx.array(plan.cell_pos.astype("int32"))[None, :],
            mx.array(plan.owned),
            mx.array(plan.query_seq.astype("int32")),
            mx.array(plan.query_pos.astype("int32"))[:, None],
        ),
    )
    mine = mx.take(owned, query_seq, axis=0)  # [T, read_len]
    return mx.logical_and(mine, visible(key_pos, query_pos, window))[None, None]


class MLXCellCache(CellCache):
    def __init__(self, geometry: CacheGeometry, config: CacheConfig) -> None:
        super().__init__(geometry, config)
        self._memo = StepMemo()
        self._pools = self._fresh_pools()

    def _fresh_pools(self) -> list[LayerPools]:
        dtype = STORAGE_DTYPES[self.config.kv_dtype]
        return [
            layer_pools(
                geo.n_kv_heads, geo.head_dim, geo.v_head_dim, dtype,
                self.config.capacity, self.config.initial_capacity,
            )
            for geo in self.geometry.layers
        ]

    def attend(
        self,
        layer: int,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        scale: float,
        softcap: float = 0.0,
        sinks: Optional[mx.array] = None,
    ) -> mx.array:
        """Scatter this step's K/V into its cells of ``layer`` and attend through the mask.

        Args:
            layer: the cache layer (the op's ``cache_id``).
            q: [1, Hq, T, D] for the declared step's T tokens, RoPE applied.
            k: [1, Hkv, T, D].
            v: [1, Hkv, T, Dv].
            scale: softmax scale.
            softcap: > 0 caps scores at ``softcap * tanh(s / softcap)``.
            sinks: [Hq] per-head sink logits in the softmax's denominator, or None.

        Returns:
            [1, Hq, T, Dv] in q's dtype.
        """
        geo = check_attend(self, layer, q, k, v, softcap, sinks)
        plan = self.step_plan
        pools = self._pools[layer]
        cells, top = self._memo.get(
            plan, "cells", lambda: (mx.array(plan.cells.astype("int32")), int(plan.cells.max()))
        )
        for pool in (pools.k, pools.v):
            pool.reserve(1, top + 1)
        shape = pools.k.data.shape[:3]
        pools.write(k, v, lambda heads_first: self._memo.get(
            plan, ("index", shape, heads_first), lambda: pools.k.scatter_index(cells, heads_first=heads_first)
        ))
        keys = pools.k.read(0, 0, plan.read_len)
        values = pools.v.read(0, 0, plan.read_len)
        window = geo.policy.window
        mask = self._memo.get(plan, ("mask", window), lambda: cell_mask(plan, window, self._memo))
        return attend(q, keys, values, scale, softcap, mask, sinks)

    def _clear_storage(self) -> None:
        self._memo.clear()
        self._pools = self._fresh_pools()
