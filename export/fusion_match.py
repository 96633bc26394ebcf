"""What every fusion matcher shares: the match result and small predicates on edge nodes.

A matcher looks at one node (the candidate root of a chain) and returns a ``Fusion`` only
when the chain computes exactly the fused op's math: it checks ops, constant values
(exponents, dims, eps), dtypes and shapes, and that each inner node is read by the chain
alone (absorbing a node whose value is needed elsewhere would lose it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from .graph_builder import Builder, constant_source, ep_constant, node_args, target_key, value_of

aten = torch.ops.aten

LowerFn = Callable[[Builder, Node], None]
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_CASTS = (aten._to_copy.default,)  # the export keeps plain casts (_skip_dim_order)


@dataclass(frozen=True)
class Fusion:
    """One matched chain: ``lower`` emits the fused op for the chain's last node (its root);
    ``absorbed`` are the chain's other nodes, whose work the fused op does."""

    lower: LowerFn
    absorbed: frozenset[Node]


Matcher = Callable[[ExportedProgram, Node], Optional[Fusion]]


def is_call(x: Any, *targets: Any) -> bool:
    return isinstance(x, Node) and x.op == "call_function" and target_key(x.target) in targets


def only_read_by(node: Node, user: Node) -> bool:
    return list(node.users) == [user]


def read_within(nodes: Iterable[Node], readers: set[Node]) -> bool:
    """Every node's value is read by ``readers`` only."""
    return all(set(n.users) <= readers for n in nodes)


def dtype_of(x: Any) -> Optional[torch.dtype]:
    v = value_of(x)
    return v.dtype if isinstance(v, torch.Tensor) else None


def shape_of(x: Any) -> tuple:
    v = value_of(x)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def same_float_dtype(nodes: list[Node]) -> bool:
    dtypes = {dtype_of(n) for n in nodes}
    return len(dtypes) == 1 and next(iter(dtypes)) in FLOATS


def last_dim(x: Node) -> Optional[int]:
    """``x``'s static last-dim size (None when dynamic or x is 0-d)."""
    shape = value_of(x).shape
    return shape[-1] if shape and isinstance(shape[-1], int) else None


def operands(node: Node) -> tuple[Any, Any]:
    return node.args[0], node.args[1]


def both_orders(node: Node) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    a, b = operands(node)
    return (a, b), (b, a)


def plain_add(node: Any) -> bool:
    return is_call(node, aten.add.Tensor) and node_args(node).get("alpha", 1) == 1


def scalar_value(ep: ExportedProgram, x: Any) -> Optional[float]:
    """``x`` as a Python float when it is a number or a 0-d constant tensor."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    source = constant_source(ep, x) if isinstance(x, Node) else None
    return float(source.tensor().item()) if source is not None and not source.shape else None


def plain_cast(node: Any) -> bool:
    """``node`` converts a float tensor to another float dtype and does nothing else."""
    if not is_call(node, *_CASTS):
        return False
    extra = {k: v for k, v in node.kwargs.items() if k not in ("dtype", "layout", "device")}
    return not extra and dtype_of(node) in FLOATS and dtype_of(node.args[0]) in FLOATS


def through_cast(node: Any) -> tuple[Any, Optional[Node]]:
    """(the value ``node`` casts, the cast node) when it is a plain cast, else (node, None)."""
    return (node.args[0], node) if plain_cast(node) else (node, None)


# Ops a constant expression may use (weights prepared in the graph, like Gemma's 1 + w).
_FOLDABLE = (aten._to_copy.default, aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.alias_copy.default)


def constant_value(ep: ExportedProgram, x: Any, depth: int = 4) -> Optional[tuple[torch.Tensor, list[Node]]]:
    """The tensor ``x`` always holds when it is computed from constants alone (evaluated
    with the same torch ops the program runs, so bit-exact), with the call nodes computing
    it; None otherwise."""
    if not isinstance(x, Node):
        return None
    tensor = ep_constant(ep, x)
    if tensor is not None:
        return tensor, []
    if depth == 0 or not is_call(x, *_FOLDABLE):
        return None
    args: list[Any] = []
    nodes = [x]
    for a in x.args:
        if isinstance(a, Node):
            folded = constant_value(ep, a, depth - 1)
            if folded is None:
                return None
            args.append(folded[0])
            nodes += folded[1]
        else:
            args.append(a)
    kwargs = {k: v for k, v in x.kwargs.items() if k != "device"}
    with torch.no_grad():
        return target_key(x.target)(*args, **kwargs), nodes


def constant_source_name(ep: ExportedProgram, x: Node) -> str:
    """The state-dict name of the first constant that ``x`` is computed from (``x``'s own
    name when none is found), to name a folded constant after its source."""
    for node in (x, *x.all_input_nodes):
        spec = next((s for s in ep.graph_signature.input_specs if s.arg.name == node.name), None)
        if spec is not None and spec.target is not None:
            return spec.target
        if node is not x:
            return constant_source_name(ep, node)
    return x.name
