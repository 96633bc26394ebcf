"""Lowerings of layout ops into the table of ``op_lowerings``: views, permutes, slices and
slice writes, selects, (un)squeezes, expands, repeats, concatenation, splits and the
getitem that picks a split's part. Dims are made non-negative and dynamic sizes become
``SlotRef``s, as everywhere in the table."""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch.fx import Node

from .graph_builder import Builder, node_args, norm_dim, rank_of, target_key
from .op_lowerings import _SLICE_END, _out_dtype, _register

aten = torch.ops.aten


def _view(b: Builder, node: Node) -> None:
    b.emit_node(node, "view", (b.slots[node.args[0]],), {"shape": b.sizes(node.args[1])})


_register([aten.view_copy.default, aten.view.default, aten._unsafe_view.default], _view)


def _permute(b: Builder, node: Node) -> None:
    x = node.args[0]
    rank = rank_of(x)
    key = target_key(node.target)
    if key is aten.permute_copy.default:
        dims = [norm_dim(d, rank) for d in node.args[1]]
    else:  # transpose / t: swap two axes
        d0, d1 = (norm_dim(d, rank) for d in node.args[1:3]) if key is aten.transpose_copy.int else (0, 1)
        dims = list(range(rank))
        if rank >= 2:
            dims[d0], dims[d1] = dims[d1], dims[d0]
    b.emit_node(node, "permute", (b.slots[x],), {"dims": tuple(dims)})


_register([aten.permute_copy.default, aten.transpose_copy.int, aten.t_copy.default], _permute)


def _slice_attrs(b: Builder, args: dict[str, Any]) -> dict[str, Any]:
    """The ``slice`` / ``slice_update`` attributes of a slice over ``args["self"]``."""
    start, end = args["start"], args["end"]
    return {
        "dim": norm_dim(args["dim"], rank_of(args["self"])),
        "start": 0 if start is None else b.size(start),
        "end": _SLICE_END if end is None else b.size(end),
        "step": int(args["step"]),
    }


def _slice(b: Builder, node: Node) -> None:
    args = node_args(node)
    b.emit_node(node, "slice", (b.slots[args["self"]],), _slice_attrs(b, args))


def _slice_scatter(b: Builder, node: Node) -> None:
    args = node_args(node)
    dtype = _out_dtype(node)
    b.emit_node(node, "slice_update", (b.operand(args["self"], dtype), b.operand(args["src"], dtype)),
                _slice_attrs(b, args))  # fmt: skip


_register(aten.slice_copy.Tensor, _slice)
_register(aten.slice_scatter.default, _slice_scatter)


def _select(b: Builder, node: Node) -> None:
    args = node_args(node)
    x = args["self"]
    b.emit_node(node, "select", (b.slots[x],), {"dim": norm_dim(args["dim"], rank_of(x)), "index": b.size(args["index"])})


_register(aten.select_copy.int, _select)


def _unsqueeze(b: Builder, node: Node) -> None:
    x, dim = node.args[0], node.args[1]
    b.emit_node(node, "unsqueeze", (b.slots[x],), {"dim": norm_dim(dim, rank_of(x) + 1)})


_register(aten.unsqueeze_copy.default, _unsqueeze)


def _squeeze(b: Builder, node: Node) -> None:
    x = node.args[0]
    rank = rank_of(x)
    dims = node.args[1] if len(node.args) > 1 else range(rank)
    dims = dims if isinstance(dims, (list, tuple, range)) else (dims,)
    b.emit_node(node, "squeeze", (b.slots[x],), {"dims": tuple(sorted(norm_dim(d, rank) for d in dims))})


_register([aten.squeeze_copy.dims, aten.squeeze_copy.dim, aten.squeeze_copy.default], _squeeze)


def _expand(b: Builder, node: Node) -> None:
    b.emit_node(node, "expand", (b.slots[node.args[0]],), {"shape": b.sizes(node.args[1])})


_register(aten.expand_copy.default, _expand)


def _repeat(b: Builder, node: Node) -> None:
    b.emit_node(node, "tile", (b.slots[node.args[0]],), {"reps": b.sizes(node.args[1])})


_register(aten.repeat.default, _repeat)


def _cat(b: Builder, node: Node) -> None:
    args = node_args(node)
    dtype = _out_dtype(node)
    rank = node.meta["val"].dim()
    b.emit_node(node, "cat", tuple(b.operand(t, dtype) for t in args["tensors"]), {"dim": norm_dim(args["dim"], rank)})


_register(aten.cat.default, _cat)


def _split(b: Builder, node: Node) -> None:
    args = node_args(node)
    x = args["self"]
    dim = norm_dim(args["dim"], rank_of(x))
    pieces = node.meta["val"]
    if "split_sizes" in args:
        sizes = b.sizes(args["split_sizes"])
    else:  # split_copy.Tensor: the check guarantees static piece sizes
        sizes = tuple(int(p.shape[dim]) for p in pieces)
    b.slots[node] = tuple(b.emit("split", (b.slots[x],), {"sizes": sizes, "dim": dim}, node.name,
                                 [b.tensor_type(p) for p in pieces]))  # fmt: skip


def _check_split(node: Node) -> Optional[str]:
    if target_key(node.target) is aten.split_copy.Tensor:
        if not all(isinstance(d, int) for p in node.meta["val"] for d in p.shape):
            return "dynamic piece sizes"
    return None


_register([aten.split_with_sizes_copy.default, aten.split_copy.Tensor], _split, _check_split)


def _getitem(b: Builder, node: Node) -> None:
    source, index = node.args
    pieces = b.slots[source]
    assert isinstance(pieces, tuple)
    b.slots[node] = pieces[index]


_register(operator.getitem, _getitem)
