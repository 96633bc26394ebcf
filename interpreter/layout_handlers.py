"""Handlers of the layout ops: views, permutations, slices, joins and splits.

A GPU step's host time grows with its graph nodes (``bench/gpu_encode.py``), so where a
permutation moves only axes of size 1 (a decode step's one token beside its heads) it is
folded into the reshape beside it instead of costing a transpose node.
"""
from __future__ import annotations

import math
from itertools import accumulate
from typing import Any

from mlx_pte.runtime.mlx.bootstrap import mx

from .handlers import Args, RunContext, handles


@handles("view")
def _view(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    return args[0].reshape(attrs["shape"])


@handles("permute")
def _permute(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    return mx.transpose(args[0], attrs["dims"])


def _keeps_order(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    """Whether permuting axes of ``shape`` by ``dims`` moves only axes of size 1, so the
    elements keep their order and a reshape gives the same array (a decode step's heads
    swapping places with its one token). A GPU step's host time grows with its graph
    nodes, and a reshape merges into the view beside it where a transpose cannot."""
    moved = [d for d in dims if shape[d] != 1]
    return moved == sorted(moved)


def _resolved(shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    """``shape`` with its -1 (if any) worked out for ``size`` elements."""
    if -1 not in shape:
        return tuple(shape)
    known = math.prod(n for n in shape if n != -1)
    return tuple(size // known if n == -1 else n for n in shape)


def _view_then_permute(x: mx.array, shape: tuple[int, ...], dims: tuple[int, ...]) -> mx.array:
    viewed = _resolved(shape, x.size)
    if _keeps_order(viewed, dims):
        return x.reshape([viewed[d] for d in dims])
    return mx.transpose(x.reshape(viewed), dims)


@handles("view_permute")
def _view_permute(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    return _view_then_permute(args[0], attrs["shape"], attrs["dims"])


@handles("split_heads")
def _split_heads(args: Args, attrs: dict[str, Any], ctx: RunContext) -> tuple[mx.array, ...]:
    (x,) = args
    heads, dim = attrs["heads"], attrs["head_dim"]
    batch, tokens, width = x.shape
    if sum(heads) * dim != width:
        raise ValueError(f"heads {list(heads)} of {dim} do not tile the last axis of {width}")
    # One view for every part, then one split: the parts are views.
    grouped = _view_then_permute(x, (batch, tokens, width // dim, dim), (0, 2, 1, 3))
    return tuple(mx.split(grouped, list(accumulate(heads[:-1])), axis=1))


@handles("permute_view")
def _permute_view(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    x, dims = args[0], attrs["dims"]
    return (x if _keeps_order(x.shape, dims) else mx.transpose(x, dims)).reshape(attrs["shape"])


def _along(x: mx.array, dim: int, index: Any) -> tuple:
    """``index`` applied on axis ``dim`` of ``x`` (a negative dim counts from the end, as in
    imported upstream programs)."""
    return (slice(None),) * (dim % x.ndim) + (index,)


def _slice_index(x: mx.array, attrs: dict[str, Any]) -> tuple:
    """The index of ``x[start:end:step]`` along ``dim`` (a slice's attributes)."""
    dim = attrs["dim"]
    # Resolve Python slice semantics on the host: torch's "to the end" is 2**63-1.
    start, end, step = slice(attrs["start"], attrs["end"], attrs["step"]).indices(x.shape[dim])
    # A backward slice through index 0 ends at -1, which as an index means the last element.
    return _along(x, dim, slice(start, None if end < 0 else end, step))


@handles("slice")
def _slice(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    (x,) = args
    return x[_slice_index(x, attrs)]


@handles("slice_update")
def _slice_update(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    x, update = args
    # Item assignment rebinds the array it is applied to: update a (lazy) copy, since x's
    # slot may have other readers.
    out = mx.array(x)
    out[_slice_index(x, attrs)] = update
    return out


@handles("select")
def _select(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    (x,) = args
    dim = attrs["dim"] % x.ndim
    index = attrs["index"] % x.shape[dim]
    # A one-element slice, squeezed: both views. (x[index] would be a gather in MLX.)
    return x[_along(x, dim, slice(index, index + 1))].squeeze(dim)


@handles("unsqueeze")
def _unsqueeze(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    return mx.expand_dims(args[0], attrs["dim"])


@handles("squeeze")
def _squeeze(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    (x,) = args
    dims = [d for d in attrs["dims"] if x.shape[d] == 1]
    return mx.squeeze(x, axis=dims) if dims else x


@handles("expand")
def _expand(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    (x,) = args
    shape = list(attrs["shape"])
    lead = len(shape) - x.ndim
    for i in range(lead, len(shape)):
        if shape[i] == -1:
            shape[i] = x.shape[i - lead]
    return mx.broadcast_to(x, shape)


@handles("tile")
def _tile(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    return mx.tile(args[0], list(attrs["reps"]))


@handles("cat")
def _cat(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    return mx.concatenate(args, axis=attrs["dim"])


@handles("split")
def _split(args: Args, attrs: dict[str, Any], ctx: RunContext) -> tuple[mx.array, ...]:
    (x,) = args
    sizes, length = attrs["sizes"], x.shape[attrs["dim"]]
    # MLX aborts the process on split points past int32, so pieces are checked first. The
    # last piece holds what remains and may be declared larger: upstream writes a uniform
    # torch.split as equal sizes (10 by 3: [3, 3, 3, 3], pieces 3, 3, 3, 1).
    if any(size < 0 for size in sizes) or not sum(sizes[:-1]) <= length <= sum(sizes):
        raise ValueError(f"split sizes {list(sizes)} must be >= 0 and cover the axis' {length} "
                         "(all but the last within it)")
    return tuple(mx.split(x, list(accumulate(sizes[:-1])), axis=attrs["dim"]))
