"""``single`` and ``batched-sequence`` in torch eager: private per-sequence pools.

Both read the neutral ``SequenceStepPlan``: each span of the step writes its K/V at its
run plan's write runs and attends over its read runs, so no sequence ever sees
another's history. Spans run in token order, so a sequence spanned twice in one step
sees its first span's tokens from its second.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from mlx_pte.runtime.cache import (
    BatchedSequenceCache,
    CacheConfig,
    CacheGeometry,
    SequenceStepPlan,
    SingleCache,
)

from .attention import attend, run_mask
from mlx_pte.runtime.cache.attend_checks import check_attend
from .layers import LayerPools, fork_pools, layer_pools, sequence_sizes


def attend_spans(
    plan: SequenceStepPlan,
    layer: int,
    pools_of: Callable[[int], list[LayerPools]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Write and attend every span of ``plan`` on ``layer``; outputs in token order."""
    outs = []
    for span, run in plan.runs_for_layer(layer):
        tokens = slice(span.start, span.start + span.count)
        pools = pools_of(span.seq_id)[layer]
        pools.k.write_runs(run.write, k[:, :, tokens])
        pools.v.write_runs(run.write, v[:, :, tokens])
        keys = pools.k.read_runs(run.read)
        values = pools.v.read_runs(run.read)
        outs.append(attend(q[:, :, tokens], keys, values, scale, softcap, run_mask(run), sinks))
    return torch.cat(outs, dim=2)


class ReferenceSingleCache(SingleCache):
    """One sequence; flat layers grow to the capacity, rings hold their slots."""

    def __init__(self, geometry: CacheGeometry, config: CacheConfig) -> None:
        super().__init__(geometry, config)
        self._pools = self._fresh_pools()

    def _fresh_pools(self) -> list[LayerPools]:
        return layer_pools(self.geometry, self.config, sequence_sizes(self.policies, self.config))

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
        """Write this step's K/V into ``layer`` and attend q over its window.

        Returns:
            [1, Hq, T, Dv] in q's dtype.
        """
        check_attend(self, layer, q, k, v, softcap, sinks)
        return attend_spans(self.step_plan, layer, lambda _: self._pools, q, k, v, scale, softcap, sinks)

    def _clear_storage(self) -> None:
        self._pools = self._fresh_pools()


class ReferenceBatchedSequenceCache(BatchedSequenceCache):
    """Many sequences, each with its own pools, created on the sequence's first write."""

    def __init__(self, geometry: CacheGeometry, config: CacheConfig) -> None:
        super().__init__(geometry, config)
        self._pools: dict[int, list[LayerPools]] = {}

    def _pools_of(self, seq_id: int) -> list[LayerPools]:
        if seq_id not in self._pools:
            sizes = sequence_sizes(self.policies, self.config)
            self._pools[seq_id] = layer_pools(self.geometry, self.config, sizes)
        return self._pools[seq_id]

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
        """Write each span's K/V into its sequence's ``layer`` and attend its queries.

        Returns:
            [1, Hq, T, Dv] in q's dtype, token order as declared.
        """
        check_attend(self, layer, q, k, v, softcap, sinks)
        return attend_spans(self.step_plan, layer, self._pools_of, q, k, v, scale, softcap, sinks)

    def _release_sequence(self, seq_id: int) -> None:
        self._pools.pop(seq_id, None)

    def _fork_sequence(self, src: int, dst: int, upto: int) -> None:
        self._pools[dst] = fork_pools(self._pools_of(src), self.policies, upto)

    def _clear_storage(self) -> None:
        self._pools.clear()
