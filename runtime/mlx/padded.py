"""A sequence-layout step attended as one padded batch over a range of pool rows.

Each span of the step is one batch row: its sequence's row of the pool, read in slot
order (a view: no gather copy), its queries padded to the longest span, and an explicit
mask computed from each slot's position. Attention does not care in which order keys
come, so a wrapped ring needs no reordering: a slot's position is recovered from the
row's newest position, and the mask does the rest. Rows in the range that take no part
in the step see nothing and their outputs are dropped.

A decode step (one query per row) whose rows see different slots skips the mask on
CUDA: ``decode_attention`` derives what each row sees from its query position instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

import numpy as np

from mlx_pte.runtime.mlx.bootstrap import mx

from mlx_pte.runtime.cache import RingLayout, RunPlan, Span
from mlx_pte.runtime.cache.plans import Layout

from . import decode_attention
from .attention import attend
from .masks import Mask, visible
from .pool import LayerPools

# What one more span costs the span loop (a read and an attention call per layer, about
# 50 us on CPU), in padded query-key pairs (about 1 us each over a [8, keys, 64] window):
# measured on decode steps of 2..32 sequences with equal and unequal histories.
SPAN_OVERHEAD_PAIRS = 64


@dataclass(frozen=True, eq=False)
class PaddedBatch:
    """Where a step's tokens go in a padded batch over pool rows ``[lo, hi)``.

    Batch row b is pool row ``lo + b``; its padded query i is the token of that row's
    span at offset i (or padding).
    """

    lo: int
    hi: int
    t_max: int
    read_len: int  # slots read per row
    gather: Optional[mx.array]  # int32 [rows * t_max]: token of each padded query (T = padding)
    scatter: Optional[mx.array]  # int32 [T]: padded query of each token
    query_pos: np.ndarray  # int32 [rows, t_max]: each padded query's position (-1: padding)
    newest: np.ndarray  # int32 [rows]: each row's newest position after the step (-1: not in it)
    ring: Optional[RingLayout]
    full_view: bool  # one query per row, each seeing every slot read: no mask

    @cached_property
    def mask(self) -> Mask:
        """bool [rows, 1, t_max, read_len], None when every row sees every slot; built on
        first use (a decode step that runs ``decode_attention`` needs none)."""
        if self.full_view:
            return None
        return _slot_mask(self.query_pos, self.newest, self.read_len, self.ring)

    @property
    def masked_decode(self) -> bool:
        """One query per row, rows seeing different slots: the case ``decode_attention``
        takes without a mask (a step whose rows all see every slot read needs none)."""
        return self.t_max == 1 and not self.full_view

    @cached_property
    def query_positions(self) -> mx.array:
        """int32 [rows]: each row's one query position in a ``masked_decode`` step (-1 for
        rows outside the step), from which ``decode_attention`` derives what it sees."""
        return mx.array(self.newest)


def plan_padded(spans: Sequence[tuple[Span, RunPlan]], layout: Layout) -> Optional[PaddedBatch]:
    """The padded batch for one layout's spans, or None when a span loop is cheaper.

    Args:
        spans: the step's spans with their run plans on this layout, in token order;
            a span's sequence id is its pool row.
        layout: the layout the runs were planned on.
    """
    n = len(spans)
    if n < 2 or len({span.seq_id for span, _ in spans}) < n:
        # One span gains nothing; a sequence spanned twice would need its row twice.
        return None
    rows = [span.seq_id for span, _ in spans]
    lo, hi = min(rows), max(rows) + 1
    t_max = max(span.count for span, _ in spans)
    end = max(run.position + run.count for _, run in spans)
    ring = layout if isinstance(layout, RingLayout) else None
    read_len = min(end, ring.slots) if ring else end
    padded = (hi - lo) * t_max * read_len
    actual = sum(run.count * run.read_len for _, run in spans)
    if padded > actual + n * SPAN_OVERHEAD_PAIRS:
        return None

    tokens = sum(span.count for span, _ in spans)
    scatter = np.empty(tokens, np.int32)
    gather = np.full((hi - lo) * t_max, tokens, np.int32)
    query_pos = np.full((hi - lo, t_max), -1, np.int32)
    newest = np.full(hi - lo, -1, np.int32)
    for span, run in spans:
        b = span.seq_id - lo
        at = slice(span.start, span.start + span.count)
        scatter[at] = b * t_max + np.arange(span.count)
        gather[scatter[at]] = np.arange(span.start, span.start + span.count)
        query_pos[b, : span.count] = np.arange(run.position, run.position + run.count)
        newest[b] = run.position + run.count - 1
    in_order = bool(np.array_equal(scatter, np.arange((hi - lo) * t_max)))
    # One query per row that may see every slot read needs no mask, so the fused kernel
    # runs mask-free; rows of the range outside the step need none either, their outputs
    # being dropped.
    full_view = t_max == 1 and all(run.read_len == read_len for _, run in spans)
    return PaddedBatch(
        lo=lo,
        hi=hi,
        t_max=t_max,
        read_len=read_len,
        gather=None if in_order else mx.array(gather),
        scatter=None if in_order else mx.array(scatter),
        query_pos=query_pos,
        newest=newest,
        ring=ring,
        full_view=full_view,
    )


def _slot_mask(
    query_pos: np.ndarray, newest: np.ndarray, read_len: int, ring: Optional[RingLayout]
) -> mx.array:
    """bool [rows, 1, t_max, read_len] from each slot's position, built on device.

    Flat: slot s holds position s. Ring of R slots whose newest position is p: slot s
    holds the position congruent to s in ``(p - R, p]`` (negative: never written).
    """
    slot = mx.arange(read_len, dtype=mx.int32)[None, :]
    if ring:
        last = mx.array(newest)[:, None]
        key_pos = last - (last - slot + ring.slots) % ring.slots
        window = ring.window
    else:
        key_pos = slot
        window = 0
    seen = visible(key_pos[:, None, :], mx.array(query_pos)[:, :, None], window)
    return seen[:, None]


def attend_padded(
    pools: LayerPools, batch: PaddedBatch, q: mx.array, scale: float, softcap: float,
    sinks: Optional[mx.array] = None,
) -> mx.array:
    """Attend every row in one call; the step's K/V are already written.

    Returns:
        [1, Hq, T, Dv] in q's dtype, token order.
    """
    keys = pools.k.window(batch.lo, batch.hi, batch.read_len)
    values = pools.v.window(batch.lo, batch.hi, batch.read_len)
    rows = batch.hi - batch.lo
    q_heads, dim = q.shape[1], q.shape[3]
    # squeeze, not q[0]: an integer index is a gather in MLX (a kernel and a copy), a squeeze
    # a view.
    queries = q.squeeze(0).transpose(1, 0, 2)  # [T, Hq, D], token-major
    if batch.gather is not None:
        padding = mx.zeros((1, q_heads, dim), q.dtype)
        queries = mx.take(mx.concatenate([queries, padding]), batch.gather, axis=0)
    queries = queries.reshape(rows, batch.t_max, q_heads, dim).transpose(0, 2, 1, 3)
    if batch.masked_decode and decode_attention.available(queries, keys, values):
        ring = batch.ring
        out = decode_attention.decode_attention(
            queries, keys, values, batch.query_positions, scale,
            ring_slots=ring.slots if ring else 0, window=ring.window if ring else 0, softcap=softcap, sinks=sinks,
        )
    else:
        out = attend(queries, keys, values, scale, softcap, batch.mask, sinks)  # [rows, Hq, t_max, Dv]
    out = out.transpose(0, 2, 1, 3).reshape(rows * batch.t_max, q_heads, out.shape[-1])
    if batch.scatter is not None:
        out = mx.take(out, batch.scatter, axis=0)
    return out.transpose(1, 0, 2)[None]
