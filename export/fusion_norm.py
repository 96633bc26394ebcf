"""RMSNorm chains → one ``rms_norm`` (MLX's fast kernel), in every dtype.

HF writes RMSNorm out of elementwise ops, upcasting half-precision inputs first::

    u = x.float()                                  # absent when x is fp32
    n = u * rsqrt(mean(u ** 2, -1, keepdim) + eps)  # fp32 (Gemma3n: pow(..., -0.5))
    Llama, Qwen3, Mistral:  out = w * n.to(x.dtype)        (the weight after rounding)
    Gemma:                  out = (n * (1 + w.float())).to(x.dtype)  (the weight in fp32)
    no weight (Gemma3n):    out = n.to(x.dtype)

``rms_norm`` computes the same thing in the same order: normalize in fp32, round to
``result_type(x, weight)``, multiply by the weight in that dtype, then cast to the
optional ``dtype``. A chain matches only when its rounding dtype is that result type;
anything else (a chain computed in half precision, a different eps placement or
exponent, a weight of the wrong shape) stays unfused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from .fusion_match import (
    Fusion,
    aten,
    both_orders,
    constant_source_name,
    constant_value,
    dtype_of,
    is_call,
    last_dim,
    plain_add,
    read_within,
    scalar_value,
    shape_of,
    through_cast,
)
from .graph_builder import DTYPE_NAMES, Builder, node_args, norm_dim


@dataclass(frozen=True)
class _Normalized:
    """``n = u * rsqrt(mean(u**2) + eps)`` in fp32, ``u`` = x or x upcast."""

    x: Node
    eps: float
    nodes: tuple[Node, ...]  # n and the nodes computing it from x


def _is_rsqrt(node: Any) -> bool:
    # Gemma3n writes pow(m, -0.5); torch computes that exponent with rsqrt.
    return is_call(node, aten.rsqrt.default) or (is_call(node, aten.pow.Tensor_Scalar) and node.args[1] == -0.5)


def _normalized(ep: ExportedProgram, n: Any) -> Optional[_Normalized]:
    if not is_call(n, aten.mul.Tensor) or dtype_of(n) != torch.float32:
        return None
    for u, rsqrt in both_orders(n):
        if not (isinstance(u, Node) and _is_rsqrt(rsqrt) and plain_add(rsqrt.args[0])):
            continue
        shifted = rsqrt.args[0]
        for mean, eps_arg in both_orders(shifted):
            eps = scalar_value(ep, eps_arg)
            if eps is None or not is_call(mean, aten.mean.dim):
                continue
            args = node_args(mean)
            square, dims, rank = args["self"], args["dim"], len(shape_of(u))
            if not (
                is_call(square, aten.pow.Tensor_Scalar) and square.args[0] is u and square.args[1] == 2
                and args["keepdim"] and dims is not None and len(dims) == 1 and rank
                and norm_dim(dims[0], rank) == rank - 1 and args.get("dtype") is None
            ):  # fmt: skip
                continue
            x, upcast = through_cast(u)
            if dtype_of(u) != torch.float32 or not isinstance(x, Node) or last_dim(x) is None:
                continue
            nodes = (n, rsqrt, shifted, mean, square) + ((upcast,) if upcast is not None else ())
            return _Normalized(x, eps, nodes)
    return None


@dataclass(frozen=True)
class _Weight:
    node: Node  # the multiply's weight operand
    value: torch.Tensor
    computed: tuple[Node, ...]  # the call nodes computing it from constants (empty: a constant itself)


@dataclass(frozen=True)
class _Match:
    norm: _Normalized
    weight: Optional[_Weight]
    rounded: torch.dtype  # the dtype the chain rounds the normalized value to
    inner: tuple[Node, ...]  # the chain's nodes between n and the root


def _weight(ep: ExportedProgram, w: Any, size: int, dtype: Optional[torch.dtype]) -> Optional[_Weight]:
    """``w`` when it is a constant [size] of ``dtype``."""
    folded = constant_value(ep, w)
    if folded is None or dtype_of(w) != dtype or tuple(folded[0].shape) != (size,):
        return None
    return _Weight(w, folded[0], tuple(folded[1]))


def _with_weight(ep: ExportedProgram, out: Node) -> Optional[_Match]:
    """``w * round(n)``, or ``n * w`` with the weight in fp32."""
    if not is_call(out, aten.mul.Tensor):
        return None
    for w, r in both_orders(out):
        n, round_cast = through_cast(r)
        norm = _normalized(ep, n)
        size = last_dim(norm.x) if norm is not None else None
        weight = _weight(ep, w, size, dtype_of(r)) if norm is not None and size is not None else None
        if norm is None or weight is None or dtype_of(out) != dtype_of(r):
            continue
        return _Match(norm, weight, dtype_of(r), (out,) + ((round_cast,) if round_cast is not None else ()))
    return None


def match_rms_norm(ep: ExportedProgram, root: Node) -> Optional[Fusion]:
    out, final_cast = through_cast(root)
    match = _with_weight(ep, out)
    if match is None:
        norm = _normalized(ep, out)
        # Without a weight the one rounding is the chain's last cast (or none at all).
        match = _Match(norm, None, dtype_of(root), (out,)) if norm is not None else None
    if match is None:
        return None
    norm, weight = match.norm, match.weight
    # rms_norm rounds the normalized value to result_type(x, weight); the chain must too.
    result = torch.promote_types(dtype_of(norm.x), weight.value.dtype if weight else dtype_of(norm.x))
    chain = (set(norm.nodes) | set(match.inner) | set(weight.computed if weight else ())) - {root}
    if match.rounded != result or shape_of(root) != shape_of(norm.x) or not read_within(chain, chain | {root}):
        return None
    attrs: dict[str, Any] = {"eps": norm.eps}
    if dtype_of(root) != result:
        attrs["dtype"] = DTYPE_NAMES[dtype_of(root)]

    def lower(b: Builder, node: Node) -> None:
        w_slot = None
        if weight is not None:
            shared = not weight.computed and weight.node in b.slots
            name = f"{constant_source_name(b.ep, weight.node)}.folded"
            w_slot = b.slots[weight.node] if shared else b.add_constant(name, weight.value)
        b.emit_node(node, "rms_norm", (b.slots[norm.x], w_slot), attrs)

    return Fusion(lower, frozenset(chain))
