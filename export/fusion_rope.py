"""Rotary-embedding chains → one ``rope`` (or ``rope_half``) per rotated tensor.

HF's ``apply_rotary_pos_emb`` with ``rotate_half`` is::

    x * cos + cat(-x[..., d/2:], x[..., :d/2]) * sin

with ``cos``/``sin`` tables of [1, T, d] unsqueezed to the heads axis. When the tables are
HF's default rotary embedding of the token positions, ``cos(cat(f, f))`` with
``f = positions.float() * inv_freq`` (attention scaling 1, rounded to x's dtype), the chain
becomes ``rope(x, positions, inv_freq)``, which MLX runs on its fused kernel where it has
one. Other tables (computed some other way) keep ``rope_half(x, cos, sin)``: the tables
are computed once per forward by the graph and gathered by every layer.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from .fusion_match import (
    Fusion,
    aten,
    both_orders,
    dtype_of,
    is_call,
    last_dim,
    only_read_by,
    operands,
    plain_add,
    same_float_dtype,
    scalar_value,
    shape_of,
    through_cast,
)
from .graph_builder import Builder, ep_constant, node_args, norm_dim, value_of


def match_rope(ep: ExportedProgram, root: Node) -> Optional[Fusion]:
    if not plain_add(root):
        return None
    for direct, rotated in both_orders(root):
        if not (is_call(direct, aten.mul.Tensor) and is_call(rotated, aten.mul.Tensor)):
            continue
        for rot, sin in both_orders(rotated):
            fusion = _rope_chain(ep, root, direct, rotated, rot, sin)
            if fusion is not None:
                return fusion
    return None


def _half_slice(node: Any, x: Node, start: int, end_at_least: int, half: int) -> bool:
    """``node`` is ``x[..., start:end]`` along the last dim, step 1, covering ``half`` items."""
    if not is_call(node, aten.slice_copy.Tensor):
        return False
    args = node_args(node)
    rank = value_of(x).dim()
    end = args["end"]
    return (
        args["self"] is x and norm_dim(args["dim"], rank) == rank - 1 and args["step"] == 1
        and (args["start"] or 0) == start and isinstance(end, int) and end >= end_at_least
        and value_of(node).shape[-1] == half
    )  # fmt: skip


def _rope_chain(ep: ExportedProgram, root: Node, direct: Node, rotated: Node, rot: Any, sin: Any) -> Optional[Fusion]:
    if not (is_call(rot, aten.cat.default) and isinstance(sin, Node)):
        return None
    tensors, dim = node_args(rot)["tensors"], node_args(rot)["dim"]
    if len(tensors) != 2 or not is_call(tensors[0], aten.neg.default):
        return None
    neg, low = tensors
    high = neg.args[0]
    x = low.args[0] if is_call(low, aten.slice_copy.Tensor) else None
    size = last_dim(x) if isinstance(x, Node) else None
    if size is None or size % 2 or norm_dim(dim, value_of(rot).dim()) != value_of(rot).dim() - 1:
        return None
    half = size // 2
    if not (_half_slice(low, x, 0, half, half) and _half_slice(high, x, half, size, half)):
        return None
    a, c = operands(direct)
    if a is not x and c is not x:
        return None
    cos = c if a is x else a
    chain = [high, neg, low, rot, direct, rotated]
    users = [neg, rot, rot, rotated, root, root]
    if (
        not isinstance(cos, Node)
        or value_of(root).shape != value_of(x).shape
        or not same_float_dtype([x, cos, sin, *chain, root])
        or not all(only_read_by(n, u) for n, u in zip(chain, users))
    ):  # fmt: skip
        return None
    source = _default_rotary(ep, x, cos, sin)
    if source is not None:
        positions, inv_freq, seq_axis = source

        def lower(b: Builder, node: Node) -> None:
            b.emit_node(node, "rope", (b.slots[x], b.slots[positions], b.slots[inv_freq]), {"seq_axis": seq_axis})

    else:

        def lower(b: Builder, node: Node) -> None:
            b.emit_node(node, "rope_half", (b.slots[x], b.slots[cos], b.slots[sin]))

    return Fusion(lower, frozenset(chain))


def _default_rotary(ep: ExportedProgram, x: Node, cos: Node, sin: Node) -> Optional[tuple[Node, Node, int]]:
    """(positions [T], inv_freq [d/2], x's token axis) when ``cos``/``sin`` are HF's default
    rotary tables of x's tokens, unsqueezed to broadcast over x's heads ([1, H, T, d] or
    [1, T, H, d]); the tables' own nodes are left to dead-code removal (every layer reads
    them)."""
    x_shape = shape_of(x)
    if len(x_shape) != 4 or x_shape[0] != 1:
        return None
    unsqueezed = [_unsqueezed_heads(t) for t in (cos, sin)]
    if None in unsqueezed or unsqueezed[0][1] != unsqueezed[1][1]:  # type: ignore[index]
        return None
    heads_axis = unsqueezed[0][1]  # type: ignore[index]
    seq_axis = 3 - heads_axis
    tables = [u[0] for u in unsqueezed]  # type: ignore[index]
    found = [_table_source(ep, t, fn, dtype_of(x)) for t, fn in zip(tables, (aten.cos.default, aten.sin.default))]
    if None in found or found[0] != found[1]:
        return None
    f = node_args(found[0])["tensors"][0]
    for pos_float, inv_freq in both_orders(f):
        inv = ep_constant(ep, inv_freq) if isinstance(inv_freq, Node) else None
        if not _int_to_float32(pos_float) or inv is None or inv.dtype != torch.float32:
            continue
        source = _token_axis(pos_float.args[0])
        if tuple(inv.shape) == (x_shape[-1] // 2,) and source is not None and shape_of(source) == (x_shape[seq_axis],):
            return source, inv_freq, seq_axis
    return None


def _int_to_float32(node: Any) -> bool:
    """``node`` is ``ints.float()`` (a plain conversion of an integer tensor)."""
    return (
        is_call(node, aten._to_copy.default) and set(node.kwargs) <= {"dtype", "layout", "device"}
        and dtype_of(node) == torch.float32 and dtype_of(node.args[0]) in (torch.int64, torch.int32)
    )  # fmt: skip


def _unsqueezed_heads(table: Node) -> Optional[tuple[Node, int]]:
    """(the [1, T, d] table, the axis) that ``table`` unsqueezes at axis 1 or 2 (x's heads)."""
    if not is_call(table, aten.unsqueeze_copy.default) or table.args[1] not in (1, 2):
        return None
    inner = table.args[0]
    return (inner, table.args[1]) if isinstance(inner, Node) and len(shape_of(inner)) == 3 else None


def _table_source(ep: ExportedProgram, table: Node, fn: Any, dtype: torch.dtype) -> Optional[Node]:
    """The ``cat(f, f)`` node that ``table`` = fn(cat(f, f)) [* 1.0] [.to(dtype)] reads."""
    scaled, cast = through_cast(table)
    if dtype_of(table) != dtype or (cast is None and dtype != torch.float32):
        return None
    if is_call(scaled, aten.mul.Tensor):
        for value, factor in both_orders(scaled):
            if scalar_value(ep, factor) == 1.0:
                scaled = value
                break
        else:
            return None
    if not is_call(scaled, fn) or dtype_of(scaled) != torch.float32:
        return None
    emb = scaled.args[0]
    if not is_call(emb, aten.cat.default):
        return None
    parts, dim = node_args(emb)["tensors"], node_args(emb)["dim"]
    if len(parts) != 2 or parts[0] is not parts[1] or norm_dim(dim, len(shape_of(emb))) != 2:
        return None
    f = parts[0]
    return emb if is_call(f, aten.mul.Tensor) and len(shape_of(f)) == 3 else None


def _token_axis(positions: Any) -> Optional[Node]:
    """The 1-D int tensor that ``positions`` [1, T, 1] unsqueezes (``p[None, :, None]``)."""
    if not is_call(positions, aten.unsqueeze_copy.default) or positions.args[1] != 2:
        return None
    row = positions.args[0]
    if not is_call(row, aten.unsqueeze_copy.default) or row.args[1] != 0:
        return None
    source = row.args[0]
    ok = isinstance(source, Node) and dtype_of(source) in (torch.int64, torch.int32) and len(shape_of(source)) == 1
    return source if ok else None
