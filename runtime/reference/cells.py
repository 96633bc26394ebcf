"""``batched-cell`` in torch eager: one pool of cells per layer, shared by all sequences.

Token i's K/V land in cell ``plan.cells[i]``; every query reads cells ``[0, read_len)``
and the neutral plan's mask (owner, position, window) decides what it sees, so a
window only narrows the mask and every layer spans the whole cell table.
"""
from __future__ import annotations

from typing import Optional

import torch

from mlx_pte.runtime.cache import CacheConfig, CacheGeometry, CellCache, Run

from .attention import attend
from mlx_pte.runtime.cache.attend_checks import check_attend
from .layers import LayerPools, PoolSize, layer_pools


class ReferenceCellCache(CellCache):
    def __init__(self, geometry: CacheGeometry, config: CacheConfig) -> None:
        super().__init__(geometry, config)
        self._pools = self._fresh_pools()

    def _fresh_pools(self) -> list[LayerPools]:
        # A window only narrows the mask: every layer spans the whole cell table.
        size = PoolSize(self.config.capacity, self.config.initial_capacity)
        return layer_pools(self.geometry, self.config, (size,) * self.n_layers)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        softcap: float = 0.0,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Scatter this step's K/V into its cells of ``layer`` and attend through the mask.

        Returns:
            [1, Hq, T, Dv] in q's dtype.
        """
        geo = check_attend(self, layer, q, k, v, softcap, sinks)
        plan = self.step_plan
        pools = self._pools[layer]
        cells = torch.tensor(plan.cells)
        pools.k.scatter(cells, k)
        pools.v.scatter(cells, v)
        table = (Run(0, plan.read_len),)
        keys = pools.k.read_runs(table)
        values = pools.v.read_runs(table)
        mask = torch.tensor(plan.mask(geo.policy.window))
        return attend(q, keys, values, scale, softcap, mask, sinks)

    def _clear_storage(self) -> None:
        self._pools = self._fresh_pools()
