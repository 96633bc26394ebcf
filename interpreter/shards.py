"""The MLX side of sharding a program (``ir.sharding`` plans it): each rank's slice of the
weights, and the bytes its ``all_sum`` instructions exchange."""
from __future__ import annotations

import math
from typing import Any, Mapping

from mlx_pte.runtime.mlx.bootstrap import mx

from mlx_pte.ir.graph import Graph, TensorType
from mlx_pte.ir.payload import ITEMSIZE
from mlx_pte.ir.sharding import ConstantSlice, plan_shards

from .groups import register_group


def take_slice(array: mx.array, sl: ConstantSlice, rank: int, size: int) -> mx.array:
    """Rank ``rank``'s share of ``array`` (copied, so the whole array can be freed)."""
    pieces = []
    for start, stop in sl.ranges(rank, size):
        index = [slice(None)] * array.ndim
        index[sl.axis] = slice(start, stop)
        pieces.append(array[tuple(index)])
    share = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=sl.axis)
    share = mx.contiguous(share)
    mx.eval(share)
    return share


def shard_program(
    graph: Graph, weights: Mapping[int, mx.array], manifest: Mapping[str, Any], group: Any
) -> tuple[Graph, dict[int, mx.array], dict[str, Any]]:
    """``graph``, its weights and manifest rewritten for this process's rank of ``group``.

    Raises:
        ShardingError: the program cannot be split over the group's size (why, and what to do).
    """
    rank, size = group.rank(), group.size()
    plan = plan_shards(graph, manifest, rank, size, register_group(group))
    sharded = {s: (take_slice(a, plan.slices[s], rank, size) if s in plan.slices else a) for s, a in weights.items()}
    return plan.graph, sharded, plan.manifest


def all_sum_bytes_per_token(graph: Graph) -> int:
    """Bytes one token's forward hands to ``all_sum`` on each rank (the ring moves about
    ``2 (N - 1) / N`` times this in and out of every rank): per instruction, its result's
    static sizes (the token axis is the dynamic one) times the item size."""
    total = 0
    for instr in graph.instructions:
        if instr.op == "all_sum":
            t = graph.slots[instr.outputs[0]].type
            assert isinstance(t, TensorType) and t.shape is not None and t.dtype is not None
            total += math.prod(d for d in t.shape if isinstance(d, int)) * ITEMSIZE[t.dtype]
    return total
