"""The lowering table: aten target → how its nodes become IR instructions.

Support is declarative: each entry pairs one lowering function (one per op family) with
an optional predicate that says why a particular node cannot be lowered; the partitioner
consults the table (``lowering.unsupported_reason``) before anything is lowered, so a
lowering never fails on a node it accepted.

Normalisations made here so the interpreter's handlers stay one-liners (see the catalog):
operands of elementwise ops are cast to the result's dtype (torch's type promotion,
including 0-d and Python-scalar operands, is resolved here); Python scalars become 0-d
constants of that dtype; dims are made non-negative; dynamic sizes become ``SlotRef``s to
int scalar slots (``sym_size`` and ``scalar_*`` results).
"""
from __future__ import annotations

import operator
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.fx import Node

import mlx_pte.export.custom_ops  # noqa: F401  (defines torch.ops.llm.update_and_attend)

from .graph_builder import (
    DTYPE_NAMES,
    Builder,
    is_number,
    node_args,
    norm_dim,
    rank_of,
    target_key,
    value_of,
)

aten = torch.ops.aten

# "Up to the end" for a slice; Python slicing clamps it like torch does.
_SLICE_END = sys.maxsize


LowerFn = Callable[[Builder, Node], None]
CheckFn = Callable[[Node], Optional[str]]


@dataclass(frozen=True)
class Lowering:
    """How one aten target lowers; ``check`` says why a node cannot (None = it can)."""

    fn: LowerFn
    check: Optional[CheckFn] = None


LOWERINGS: dict[Any, Lowering] = {}


def _register(targets: Any, fn: LowerFn, check: Optional[CheckFn] = None) -> None:
    for target in targets if isinstance(targets, (list, tuple)) else (targets,):
        LOWERINGS[target] = Lowering(fn, check)


def _out_dtype(node: Node) -> torch.dtype:
    return node.meta["val"].dtype


# Elementwise --------------------------------------------------------------------------
def _unary(op: str) -> LowerFn:
    def lower(b: Builder, node: Node) -> None:
        x = b.operand(node.args[0], _out_dtype(node))
        attrs = {"approximate": node_args(node)["approximate"]} if op == "gelu" else {}
        b.emit_node(node, op, (x,), attrs)

    return lower


for _op in ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid",
            "relu", "silu", "erf", "reciprocal", "gelu"):  # fmt: skip
    _register(getattr(aten, _op).default, _unary(_op))


def _promote(a: Any, b: Any) -> torch.dtype:
    """torch's result dtype for ``a op b`` (0-d tensors and scalars rank lower)."""

    def probe(x: Any) -> Any:
        if isinstance(x, Node):
            v = value_of(x)
            return torch.empty((1,) * v.dim() if v.dim() else (), dtype=v.dtype)
        return x

    return torch.result_type(probe(a), probe(b))


def _binary(op: str, compare: bool = False) -> LowerFn:
    def lower(b: Builder, node: Node) -> None:
        lhs, rhs = node.args[0], node.args[1]
        dtype = _promote(lhs, rhs) if compare else _out_dtype(node)
        a_slot, b_slot = b.operand(lhs, dtype), b.operand(rhs, dtype)
        alpha = node_args(node).get("alpha", 1)
        if alpha is not None and alpha != 1:
            (b_slot,) = b.emit("mul", (b_slot, b.scalar_constant(alpha, DTYPE_NAMES[dtype])), {},
                               f"{node.name}.alpha", [b.slot_type(b_slot)])  # fmt: skip
        b.emit_node(node, op, (a_slot, b_slot))

    return lower


for _op in ("add", "sub", "mul", "div"):
    _register([getattr(aten, _op).Tensor, getattr(aten, _op).Scalar], _binary(_op))
_register([aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar], _binary("pow"))
_register(aten.maximum.default, _binary("maximum"))
_register(aten.minimum.default, _binary("minimum"))
for _op in ("lt", "le", "gt", "ge", "eq", "ne"):
    _register([getattr(aten, _op).Tensor, getattr(aten, _op).Scalar], _binary(_op, compare=True))
# The result is bool, so operands are cast to bool (nonzero is true, as torch reads them).
_register(aten.logical_and.default, _binary("logical_and"))
_register(aten.logical_or.default, _binary("logical_or"))
_register(aten.logical_not.default, _unary("logical_not"))


def _where(b: Builder, node: Node) -> None:
    cond, x, y = node.args
    dtype = _out_dtype(node)
    b.emit_node(node, "where", (b.operand(cond, torch.bool), b.operand(x, dtype), b.operand(y, dtype)))


_register(aten.where.self, _where)


def _clamp(b: Builder, node: Node) -> None:
    args = node_args(node)
    b.emit_node(node, "clamp", (b.operand(args["self"], _out_dtype(node)),), {"min": args["min"], "max": args["max"]})


def _check_clamp(node: Node) -> Optional[str]:
    args = node_args(node)
    bounds = (args["min"], args["max"])
    return None if all(x is None or is_number(x) for x in bounds) else "tensor bounds"


_register(aten.clamp.default, _clamp, _check_clamp)


# Casts and copies ---------------------------------------------------------------------
def _copy(b: Builder, node: Node) -> None:
    """A copy, alias or dtype conversion: logical values are all MLX sees (no layouts)."""
    src = node.args[0]
    slot = b.operand(src, _out_dtype(node))
    b.slots[node] = slot


_register(
    [aten._to_copy.default, aten.clone.default, aten.alias_copy.default, aten.alias.default,
     aten.detach_copy.default, aten.lift_fresh_copy.default,
     torch.ops.dim_order_ops._to_dim_order_copy.default, torch.ops.dim_order_ops._clone_dim_order.default],
    _copy,
)  # fmt: skip


def _copy_into(b: Builder, node: Node) -> None:
    """``copy(self, src)`` (a functionalized ``self.copy_(src)``): src broadcast to self's
    shape, in self's dtype; self's values are not read."""
    args = node_args(node)
    src = b.operand(args["src"], _out_dtype(node))
    if b.slot_type(src).shape == b.tensor_type(node.meta["val"]).shape:
        b.slots[node] = src
    else:
        b.emit_node(node, "expand", (src,), {"shape": b.shape_of(args["self"])})


_register(aten.copy.default, _copy_into)


# Reductions and normalisations --------------------------------------------------------
def _reduce_dims(dims: Any, rank: int) -> tuple[int, ...]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(rank))
    dims = dims if isinstance(dims, (list, tuple)) else (dims,)
    return tuple(sorted(norm_dim(d, rank) for d in dims))


def _reduction(op: str) -> LowerFn:
    def lower(b: Builder, node: Node) -> None:
        args = node_args(node)
        x = args["self"]
        dims = _reduce_dims(args.get("dim"), rank_of(x))
        b.emit_node(node, op, (b.operand(x, _out_dtype(node)),),
                    {"dims": dims, "keepdim": bool(args.get("keepdim") or False)})  # fmt: skip

    return lower


for _op in ("sum", "mean"):
    _register([getattr(aten, _op).dim_IntList if _op == "sum" else aten.mean.dim,
               getattr(aten, _op).default], _reduction(_op))  # fmt: skip
_register(aten.amax.default, _reduction("amax"))
_register(aten.amin.default, _reduction("amin"))


def _argmax(b: Builder, node: Node) -> None:
    args = node_args(node)
    x = args["self"]
    dim = None if args["dim"] is None else norm_dim(args["dim"], rank_of(x))
    b.emit_node(node, "argmax", (b.slots[x],), {"dim": dim, "keepdim": bool(args["keepdim"])})


_register(aten.argmax.default, _argmax)


def _softmax(op: str) -> LowerFn:
    def lower(b: Builder, node: Node) -> None:
        x = node.args[0]
        dim = norm_dim(node.args[1], rank_of(x))
        b.emit_node(node, op, (b.operand(x, _out_dtype(node)),), {"dim": dim})

    return lower


_register([aten._softmax.default, aten.softmax.int], _softmax("softmax"))
_register([aten._log_softmax.default, aten.log_softmax.int], _softmax("log_softmax"))


def _default_eps(node: Node, eps: Optional[float]) -> float:
    # torch's rms_norm uses the dtype's machine epsilon when none is given.
    return float(eps) if eps is not None else float(torch.finfo(_out_dtype(node)).eps)


def _rms_norm(b: Builder, node: Node) -> None:
    args = node_args(node)
    weight = args["weight"]
    b.emit_node(node, "rms_norm", (b.slots[args["input"]], None if weight is None else b.slots[weight]),
                {"eps": _default_eps(node, args["eps"])})  # fmt: skip


def _layer_norm(b: Builder, node: Node) -> None:
    args = node_args(node)
    weight, bias = args["weight"], args["bias"]
    b.emit_node(
        node, "layer_norm",
        (b.slots[args["input"]], None if weight is None else b.slots[weight], None if bias is None else b.slots[bias]),
        {"eps": float(args["eps"])},
    )  # fmt: skip


def _check_last_dim_norm(node: Node) -> Optional[str]:
    return None if len(node_args(node)["normalized_shape"]) == 1 else "normalized over more than the last dim"


_register(aten.rms_norm.default, _rms_norm, _check_last_dim_norm)
_register(aten.layer_norm.default, _layer_norm, _check_last_dim_norm)


# Linear algebra and indexing ----------------------------------------------------------
def _matmul(b: Builder, node: Node) -> None:
    b.emit_node(node, "matmul", (b.slots[node.args[0]], b.slots[node.args[1]]))


_register([aten.mm.default, aten.bmm.default, aten.matmul.default], _matmul)


def _addmm(b: Builder, node: Node) -> None:
    args = node_args(node)
    dtype = _out_dtype(node)
    out_type = b.tensor_type(node.meta["val"])
    name = DTYPE_NAMES[dtype]

    def scaled(slot: int, factor: Any, suffix: str) -> int:
        if factor == 1:
            return slot
        return b.emit("mul", (slot, b.scalar_constant(factor, name)), {}, f"{node.name}.{suffix}",
                      [b.slot_type(slot)])[0]  # fmt: skip

    (product,) = b.emit("matmul", (b.slots[args["mat1"]], b.slots[args["mat2"]]), {}, f"{node.name}.mm", [out_type])
    b.emit_node(node, "add", (scaled(product, args["alpha"], "alpha"), scaled(b.slots[args["self"]], args["beta"], "beta")))


_register(aten.addmm.default, _addmm)


def _linear(b: Builder, node: Node) -> None:
    args = node_args(node)
    bias = None if args["bias"] is None else b.slots[args["bias"]]
    if args["weight"] in b.quantized:
        spec, *parts = b.quantized[args["weight"]]
        b.emit_node(node, "quantized_linear", (b.slots[args["input"]], *parts, bias), spec.to_dict())
        return
    b.emit_node(node, "linear", (b.slots[args["input"]], b.slots[args["weight"]], bias))


_register(aten.linear.default, _linear)


def _embedding(b: Builder, node: Node) -> None:
    args = node_args(node)
    if args["weight"] in b.quantized:
        spec, *parts = b.quantized[args["weight"]]
        attrs = {**spec.to_dict(), "dtype": DTYPE_NAMES[_out_dtype(node)]}
        b.emit_node(node, "quantized_embedding", (*parts, b.slots[args["indices"]]), attrs)
        return
    b.emit_node(node, "embedding", (b.slots[args["weight"]], b.slots[args["indices"]]))


_register(aten.embedding.default, _embedding)


def _indexed(op: str) -> LowerFn:
    def lower(b: Builder, node: Node) -> None:
        args = node_args(node)
        x = args["self"]
        b.emit_node(node, op, (b.slots[x], b.slots[args["index"]]), {"dim": norm_dim(args["dim"], rank_of(x))})

    return lower


_register(aten.index_select.default, _indexed("index_select"))
_register(aten.gather.default, _indexed("gather"))


# Creation -----------------------------------------------------------------------------
def _fill_value(node: Node) -> float:
    key = target_key(node.target)
    if key in (aten.zeros.default, aten.zeros_like.default):
        return 0.0
    if key in (aten.ones.default, aten.ones_like.default):
        return 1.0
    args = node_args(node)
    return float(args["fill_value"] if "fill_value" in args else args["s"])


def _full(b: Builder, node: Node) -> None:
    args = node_args(node)
    if "size" in args:
        shape = b.sizes(args["size"])
    elif "self" in args:  # *_like
        shape = b.shape_of(args["self"])
    else:  # scalar_tensor
        shape = ()
    b.emit_node(node, "full", (), {"shape": shape, "value": _fill_value(node), "dtype": DTYPE_NAMES[_out_dtype(node)]})


def _check_full(node: Node) -> Optional[str]:
    args = node_args(node)
    value = args.get("fill_value", args.get("s"))
    return "a symbolic fill value" if isinstance(value, Node) else None


_register([aten.full.default, aten.zeros.default, aten.ones.default, aten.full_like.default, aten.zeros_like.default,
           aten.ones_like.default, aten.scalar_tensor.default], _full, _check_full)  # fmt: skip


def _arange(b: Builder, node: Node) -> None:
    args = node_args(node)
    start = args.get("start", 0)
    b.emit_node(node, "arange", (), {
        "start": b.size(start), "end": b.size(args["end"]), "step": b.size(args.get("step", 1)),
        "dtype": DTYPE_NAMES[_out_dtype(node)],
    })  # fmt: skip


def _check_arange(node: Node) -> Optional[str]:
    args = node_args(node)
    bounds = (args.get("start", 0), args["end"], args.get("step", 1))
    return "float bounds" if any(isinstance(x, float) for x in bounds) else None


_register([aten.arange.default, aten.arange.start, aten.arange.start_step], _arange, _check_arange)


# Host integers ------------------------------------------------------------------------
def _sym_size(b: Builder, node: Node) -> None:
    x, dim = node.args
    b.scalar_slot_op(node, "sym_size", {"dim": norm_dim(dim, rank_of(x))}, (b.slots[x],))


_register(aten.sym_size.int, _sym_size)

_SCALAR_OPS = {
    operator.add: "scalar_add",
    operator.sub: "scalar_sub",
    operator.mul: "scalar_mul",
    operator.floordiv: "scalar_floordiv",
}


def _scalar_binary(b: Builder, node: Node) -> None:
    lhs, rhs = node.args
    b.scalar_slot_op(node, _SCALAR_OPS[node.target], {"a": b.size(lhs), "b": b.size(rhs)})


def _check_scalar_binary(node: Node) -> Optional[str]:
    ints = all(isinstance(value_of(a), (int, torch.SymInt)) for a in node.args)
    return None if ints else "non-integer operands"


_register(list(_SCALAR_OPS), _scalar_binary, _check_scalar_binary)


def _no_op(b: Builder, node: Node) -> None:
    """Export-time assertions on sizes: the interpreter checks input ranges instead."""


_register([aten._assert_scalar.default, aten.sym_constrain_range_for_size.default,
           aten.sym_constrain_range.default, aten._assert_tensor_metadata.default], _no_op)  # fmt: skip


# The KV cache -------------------------------------------------------------------------
def _update_and_attend(b: Builder, node: Node) -> None:
    args = node_args(node)
    # sinks is appended only when present, so other families' programs are unchanged.
    sinks = () if args.get("sinks") is None else (b.slots[args["sinks"]],)
    b.emit_node(
        node, "update_and_attend",
        tuple(b.slots[args[k]] for k in ("q", "k", "v", "positions")) + sinks,
        {"cache_id": int(args["cache_id"]), "scale": float(args["scale"]), "softcap": float(args["softcap"])},
    )  # fmt: skip


_register(torch.ops.llm.update_and_attend.default, _update_and_attend)


from . import layout_lowerings  # noqa: E402,F401  (registers views, slices, joins and splits; builds on _register)
from . import moe_lowerings  # noqa: E402,F401  (registers topk and llm::experts; it builds on _register)
