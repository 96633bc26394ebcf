"""``single`` and ``batched-sequence`` on MLX: a private history per sequence.

Both keep, per layer, one K and one V pool whose row r is sequence r's history (the
single kind uses row 0). A step writes all its tokens first (a step of one sequence in
one static slice write per contiguous slot run, others in one scatter per pool), then
attends either span by span (each span reads its run plan's runs in logical order,
with the mask the run plan asks for) or, when several sequences step together and it
is cheaper, as one padded batch over their rows (see ``padded``); a step too ragged for
one batch still batches its leading decode spans.

Writing before reading is safe: a step writes at most ``max_write`` tokens per
sequence, and a ring keeps ``window + max_write - 1`` slots, so no token of the step
lands on a slot any query of the step reads for an older position. It is also what
keeps writes in place: a read still pending on the pool would make MLX copy the whole
pool on the next write.

Forks copy rows inside the pools: a flat layer's prefix, a ring whole (a ring keeps
position q at slot ``q mod slots``, so its fork keeps every slot).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from mlx_pte.runtime.mlx.bootstrap import mx

from mlx_pte.runtime.cache import (
    BatchedSequenceCache,
    CacheBase,
    CacheConfig,
    CacheGeometry,
    RingLayout,
    RunPlan,
    SequenceStepPlan,
    Span,
    SingleCache,
)
from mlx_pte.runtime.cache.plans import Layout
from mlx_pte.runtime.cache.step import MAX_INDEX

from .attention import attend
from .launcher import evaluate
from mlx_pte.runtime.cache.attend_checks import check_attend
from .masks import StepMemo, run_mask
from .padded import PaddedBatch, attend_padded, plan_padded
from .pool import STORAGE_DTYPES, LayerPools, Pool, layer_pools


@dataclass(frozen=True)
class TokenSlots:
    """Where each token of a step lands in one layout's pools."""

    rows: mx.array  # int32 [T]: the token's sequence (= pool row)
    slots: mx.array  # int32 [T]: its position, modulo the ring's slots
    top_row: int
    top_slot: int


def token_slots(plan: SequenceStepPlan, layout: Layout) -> TokenSlots:
    rows = np.asarray(plan.step.seq_ids, np.int32)
    slots = np.asarray(plan.step.positions, np.int32)
    if isinstance(layout, RingLayout):
        slots %= layout.slots
    return TokenSlots(mx.array(rows), mx.array(slots), int(rows.max()), int(slots.max()))


def _decode_batch(
    spans: Sequence[tuple[Span, RunPlan]], layout: Layout
) -> tuple[int, Optional[PaddedBatch]]:
    """How many one-token spans lead the step and their padded batch; (0, None) when fewer
    than two lead, or a span loop is cheaper for them."""
    leading = 0
    while leading < len(spans) and spans[leading][0].count == 1:
        leading += 1
    batch = plan_padded(spans[:leading], layout) if leading >= 2 else None
    return (leading, batch) if batch is not None else (0, None)


class SequencePools:
    """The byte layer both sequence kinds share; mixed into a neutral sequence kind."""

    def _init_pools(self: CacheBase, max_rows: int) -> None:
        self._max_rows = max_rows
        self._memo = StepMemo()
        self._pools = self._fresh_pools()

    def _fresh_pools(self: CacheBase) -> list[LayerPools]:
        dtype = STORAGE_DTYPES[self.config.kv_dtype]
        pools = []
        for geo, index in zip(self.geometry.layers, self.policies.layer_layout):
            layout = self.policies.layouts[index]
            if isinstance(layout, RingLayout):
                # A ring is bounded already: allocate it whole on the first write.
                max_slots = first = layout.slots
            else:
                max_slots, first = self.config.capacity, self.config.initial_capacity
            pools.append(
                layer_pools(
                    geo.n_kv_heads, geo.head_dim, geo.v_head_dim, dtype,
                    max_slots, first, self._max_rows,
                )
            )
        return pools

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
        """Write each span's K/V into its sequence's ``layer`` and attend its queries.

        Args:
            layer: the cache layer (the op's ``cache_id``).
            q: [1, Hq, T, D] for the declared step's T tokens, RoPE applied.
            k: [1, Hkv, T, D].
            v: [1, Hkv, T, Dv].
            scale: softmax scale.
            softcap: > 0 caps scores at ``softcap * tanh(s / softcap)``.
            sinks: [Hq] per-head sink logits in the softmax's denominator, or None.

        Returns:
            [1, Hq, T, Dv] in q's dtype, token order as declared.
        """
        check_attend(self, layer, q, k, v, softcap, sinks)
        plan = self.step_plan
        index = self.policies.layer_layout[layer]
        layout = self.policies.layouts[index]
        pools = self._pools[layer]
        runs = self._memo.get(plan, ("runs", index), lambda: plan.runs_for_layer(layer))
        if len(runs) == 1:
            # One sequence: its K/V land in 1-2 contiguous slot runs.
            span, run = runs[0]
            pools.k.write_runs(span.seq_id, run.write, k)
            pools.v.write_runs(span.seq_id, run.write, v)
        else:
            at = self._memo.get(plan, ("slots", index), lambda: token_slots(plan, layout))
            for pool in (pools.k, pools.v):
                pool.reserve(at.top_row + 1, at.top_slot + 1)
            # Flat indices once per step per layout, pool shape and order, shared by the layers.
            shape = pools.k.data.shape[:3]
            pools.write(k, v, lambda heads_first: self._memo.get(
                plan, ("index", index, shape, heads_first),
                lambda: pools.k.scatter_index(at.slots, at.rows, at.top_row, heads_first),
            ))
        batch: Optional[PaddedBatch] = self._memo.get(
            plan, ("batch", index), lambda: plan_padded(runs, layout)
        )
        if batch is not None:
            return attend_padded(pools, batch, q, scale, softcap, sinks)
        # Too ragged for one batch (prompt chunks beside decode rows, as the engine mixes
        # them): the decode spans, which lead the step, still attend as one batch, and
        # each remaining span on its own.
        decoding, decode_batch = self._memo.get(plan, ("decode batch", index), lambda: _decode_batch(runs, layout))
        outs = []
        if decode_batch is not None:
            outs.append(attend_padded(pools, decode_batch, q[:, :, :decoding], scale, softcap, sinks))
        for i, (span, run) in enumerate(runs[decoding:], start=decoding):
            queries = q if len(runs) == 1 else q[:, :, span.start : span.start + span.count]
            keys = pools.k.read_runs(span.seq_id, run.read)
            values = pools.v.read_runs(span.seq_id, run.read)
            mask = self._memo.get(plan, ("span", index, i), lambda: run_mask(run))
            outs.append(attend(queries, keys, values, scale, softcap, mask, sinks))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

    def _clear_storage(self) -> None:
        self._memo.clear()
        self._pools = self._fresh_pools()


class MLXSingleCache(SequencePools, SingleCache):
    """One sequence; flat layers grow to the capacity, rings hold their slots."""

    def __init__(self, geometry: CacheGeometry, config: CacheConfig) -> None:
        super().__init__(geometry, config)
        self._init_pools(max_rows=1)


class MLXBatchedSequenceCache(SequencePools, BatchedSequenceCache):
    """Many sequences, sequence id = pool row; all share one logical capacity.

    A flat layer's rows all span the longest history, so its memory is rows x longest
    (not the sum of lengths): the price of attending every row over a view.
    """

    def __init__(self, geometry: CacheGeometry, config: CacheConfig) -> None:
        super().__init__(geometry, config)
        self._init_pools(max_rows=config.max_seqs or MAX_INDEX)

    def _rows_allocated(self) -> int:
        return max(max(pools.k.rows, pools.v.rows) for pools in self._pools)

    def _release_sequence(self, seq_id: int) -> None:
        # A row is reused by the next sequence of that id (stale slots are never read:
        # runs and masks stop at the sequence's own positions); with no sequence left,
        # hand all memory back.
        if not self.live_seqs():
            self._clear_storage()

    def _fork_sequence(self, src: int, dst: int, upto: int) -> None:
        copies: list[tuple[Pool, mx.array]] = []
        for pools, index in zip(self._pools, self.policies.layer_layout):
            layout = self.policies.layouts[index]
            length = layout.slots if isinstance(layout, RingLayout) else upto
            for pool in (pools.k, pools.v):
                prefix = pool.row_prefix(src, length)
                if prefix is not None:
                    copies.append((pool, prefix))
        # The copies are evaluated before the writes: a copy still pending when its write
        # runs keeps the pool's buffer referenced, so the write cannot reuse it and copies
        # the whole pool, every layer. Measured on the 135M model, 2 CPU cores, 8 forks
        # of ~500 positions into 24-row pools of 2,048 slots: 1.7 s lazily, 0.08 s so.
        # The sync waits for the step in flight, once per fork.
        evaluate([prefix for _, prefix in copies])
        for pool, prefix in copies:
            pool.write_prefix(dst, prefix)
