"""Rotary-embedding chains → one ``rope`` (or ``rope_half``) per rotated tensor.

HF writes the rotation in two forms. ``apply_rotary_pos_emb`` with ``rotate_half``
(most families) is::

    x * cos + cat(-x[..., d/2:], x[..., :d/2]) * sin

with ``cos``/``sin`` tables of [1, T, d] unsqueezed to the heads axis; gpt-oss's
``_apply_rotary_emb`` chunks x into halves ``a, b`` and rotates them with half-width
tables [1, T, d/2]::

    cat(a * cos - b * sin, b * cos + a * sin)

which is the same rotation. When the tables are HF's rotary embedding of the token
positions, ``cos(cat(f, f)) * s`` (``cos(f) * s`` for the half-width form) with
``f = positions.float() * inv_freq`` and ``s`` the attention scaling (1, or e.g. YaRN's),
rounded to x's dtype, the chain becomes ``rope(x, positions, inv_freq)`` (``table_scale``
s when s is not 1), which MLX runs on its fused kernel where it has one. Full-width
tables computed some other way keep ``rope_half(x, cos, sin)``: the tables are computed
once per forward by the graph and gathered by every layer; half-width ones lower op by op.
"""
from __future__ import annotations

import math
import operator
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
    if plain_add(root):
        for direct, rotated in both_orders(root):
            if not (is_call(direct, aten.mul.Tensor) and is_call(rotated, aten.mul.Tensor)):
                continue
            for rot, sin in both_orders(rotated):
                fusion = _rotate_half_chain(ep, root, direct, rotated, rot, sin)
                if fusion is not None:
                    return fusion
    elif is_call(root, aten.cat.default):
        return _chunk_chain(ep, root)
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


def _slice_halves(first: Any, second: Any) -> Optional[Node]:
    """x, when ``first`` and ``second`` are x[..., :d/2] and x[..., d/2:] (d even, static)."""
    x = first.args[0] if is_call(first, aten.slice_copy.Tensor) else None
    half = _half_width(x)
    return x if half is not None and _half_slice(first, x, 0, half, half) and _half_slice(second, x, half, 2 * half, half) else None


def _half_width(x: Any) -> Optional[int]:
    """Half of x's last dim when x is a node whose last dim is static and even."""
    size = last_dim(x) if isinstance(x, Node) else None
    return size // 2 if size is not None and size % 2 == 0 else None


def _along_last_dim(node: Node, dim: Any) -> bool:
    rank = value_of(node).dim()
    return norm_dim(dim, rank) == rank - 1


def _rotate_half_chain(ep: ExportedProgram, root: Node, direct: Node, rotated: Node, rot: Any, sin: Any) -> Optional[Fusion]:
    if not (is_call(rot, aten.cat.default) and isinstance(sin, Node)):
        return None
    tensors, dim = node_args(rot)["tensors"], node_args(rot)["dim"]
    if len(tensors) != 2 or not is_call(tensors[0], aten.neg.default):
        return None
    neg, low = tensors
    high = neg.args[0]
    x = _slice_halves(low, high)
    if x is None or not _along_last_dim(rot, dim):
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
    source = _rotary_source(ep, x, cos, sin, doubled=True)
    if source is not None:
        return Fusion(_emit_rope(x, *source), frozenset(chain))

    def lower(b: Builder, node: Node) -> None:
        b.emit_node(node, "rope_half", (b.slots[x], b.slots[cos], b.slots[sin]))

    return Fusion(lower, frozenset(chain))


def _chunk_chain(ep: ExportedProgram, root: Node) -> Optional[Fusion]:
    """``cat(a * cos - b * sin, b * cos + a * sin)`` over x's halves ``a, b``, with HF's
    half-width rotary tables (gpt-oss's ``_apply_rotary_emb``)."""
    tensors, dim = node_args(root)["tensors"], node_args(root)["dim"]
    if len(tensors) != 2 or not _along_last_dim(root, dim):
        return None
    first, second = tensors
    if not (is_call(first, aten.sub.Tensor) and node_args(first).get("alpha", 1) == 1 and plain_add(second)):
        return None
    a_cos, b_sin = operands(first)
    if not all(is_call(n, aten.mul.Tensor) for n in (a_cos, b_sin, *operands(second))):
        return None
    for a, cos in both_orders(a_cos):
        for b, sin in both_orders(b_sin):
            halves = _halves_of(a, b)
            if halves is None or not (isinstance(cos, Node) and isinstance(sin, Node)):
                continue
            x, split_nodes = halves
            for b_cos, a_sin in both_orders(second):
                if _is_product(b_cos, b, cos) and _is_product(a_sin, a, sin):
                    fusion = _checked_chunk_chain(ep, root, x, (a, b), split_nodes, (a_cos, b_sin, b_cos, a_sin), cos, sin)
                    if fusion is not None:
                        return fusion
    return None


def _is_product(node: Node, x: Any, y: Any) -> bool:
    return any(p is x and q is y for p, q in both_orders(node))


def _halves_of(a: Any, b: Any) -> Optional[tuple[Node, list[Node]]]:
    """(x, the nodes taking its halves) when ``a`` and ``b`` are x's first and second half
    along the last dim: ``torch.chunk``'s split (its two items) or two slices."""
    if not (isinstance(a, Node) and isinstance(b, Node)):
        return None
    if a.target is operator.getitem and b.target is operator.getitem:
        split = a.args[0]
        if not (b.args[0] is split and (a.args[1], b.args[1]) == (0, 1)
                and is_call(split, aten.split_with_sizes_copy.default)):  # fmt: skip
            return None
        args = node_args(split)
        x, half = args["self"], _half_width(args["self"])
        if half is None or list(args["split_sizes"]) != [half, half] or not _along_last_dim(x, args["dim"]):
            return None
        return (x, [split, a, b]) if set(split.users) == {a, b} else None
    x = _slice_halves(a, b)
    return (x, [a, b]) if x is not None else None


def _checked_chunk_chain(ep: ExportedProgram, root: Node, x: Node, halves: tuple[Node, Node], split_nodes: list[Node],
                         products: tuple[Node, Node, Node, Node], cos: Node, sin: Node) -> Optional[Fusion]:  # fmt: skip
    """The chain's fusion when each of its values is read within it alone and the tables
    are HF's half-width rotary tables."""
    a, b = halves
    a_cos, b_sin, b_cos, a_sin = products
    first, second = node_args(root)["tensors"]
    readers = {
        a: {a_cos, a_sin}, b: {b_sin, b_cos},
        a_cos: {first}, b_sin: {first}, b_cos: {second}, a_sin: {second}, first: {root}, second: {root},
    }  # fmt: skip
    arithmetic = [*products, first, second]
    if (
        value_of(root).shape != value_of(x).shape
        or not same_float_dtype([x, cos, sin, *arithmetic, root])
        or not all(set(n.users) == users for n, users in readers.items())
    ):  # fmt: skip
        return None
    source = _rotary_source(ep, x, cos, sin, doubled=False)
    return Fusion(_emit_rope(x, *source), frozenset([*split_nodes, *arithmetic])) if source is not None else None


def _emit_rope(x: Node, positions: Node, inv_freq: Node, seq_axis: int, table_scale: float):
    attrs: dict[str, Any] = {"seq_axis": seq_axis}
    if table_scale != 1.0:  # left out otherwise: files of unscaled models are unchanged
        attrs["table_scale"] = table_scale

    def lower(b: Builder, node: Node) -> None:
        b.emit_node(node, "rope", (b.slots[x], b.slots[positions], b.slots[inv_freq]), attrs)

    return lower


def _rotary_source(ep: ExportedProgram, x: Node, cos: Node, sin: Node,
                   doubled: bool) -> Optional[tuple[Node, Node, int, float]]:
    """(positions [T], inv_freq [d/2], x's token axis, table scale) when ``cos``/``sin`` are
    HF's rotary tables of x's tokens (full width, ``doubled``, or half width), unsqueezed to
    broadcast over x's heads ([1, H, T, ...] or [1, T, H, ...]); the tables' own nodes are
    left to dead-code removal (every layer reads them)."""
    x_shape = shape_of(x)
    if len(x_shape) != 4 or x_shape[0] != 1:
        return None
    unsqueezed = [_unsqueezed_heads(t) for t in (cos, sin)]
    if None in unsqueezed or unsqueezed[0][1] != unsqueezed[1][1]:  # type: ignore[index]
        return None
    heads_axis = unsqueezed[0][1]  # type: ignore[index]
    seq_axis = 3 - heads_axis
    tables = [u[0] for u in unsqueezed]  # type: ignore[index]
    found = [_table_source(ep, t, fn, dtype_of(x), doubled) for t, fn in zip(tables, (aten.cos.default, aten.sin.default))]
    if None in found or found[0] != found[1]:
        return None
    f, table_scale = found[0]  # type: ignore[misc]
    for pos_float, inv_freq in both_orders(f):
        inv = ep_constant(ep, inv_freq) if isinstance(inv_freq, Node) else None
        if not _int_to_float32(pos_float) or inv is None or inv.dtype != torch.float32:
            continue
        source = _token_axis(pos_float.args[0])
        if tuple(inv.shape) == (x_shape[-1] // 2,) and source is not None and shape_of(source) == (x_shape[seq_axis],):
            return source, inv_freq, seq_axis, table_scale
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


def _table_source(ep: ExportedProgram, table: Node, fn: Any, dtype: torch.dtype,
                  doubled: bool) -> Optional[tuple[Node, float]]:
    """(the angles ``f`` [1, T, d/2], the scale s) when ``table`` is fn(cat(f, f)) * s
    (``doubled``) or fn(f) * s, computed in fp32 and then cast to ``dtype``; ``* s`` may
    be left out (s = 1)."""
    scaled, cast = through_cast(table)
    if dtype_of(table) != dtype or (cast is None and dtype != torch.float32):
        return None
    table_scale = 1.0
    if is_call(scaled, aten.mul.Tensor):
        for value, factor in both_orders(scaled):
            number = scalar_value(ep, factor)
            if number is not None and math.isfinite(number) and is_call(value, fn):
                scaled, table_scale = value, number
                break
        else:
            return None
    if not is_call(scaled, fn) or dtype_of(scaled) != torch.float32:
        return None
    f = scaled.args[0]
    if doubled:
        if not is_call(f, aten.cat.default):
            return None
        parts, dim = node_args(f)["tensors"], node_args(f)["dim"]
        if len(parts) != 2 or parts[0] is not parts[1] or norm_dim(dim, len(shape_of(f))) != 2:
            return None
        f = parts[0]
    return (f, table_scale) if is_call(f, aten.mul.Tensor) and len(shape_of(f)) == 3 else None


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
