"""Lowering-time fusion: exact subgraphs of the edge graph that lower to one IR op.

HF modeling code writes RMSNorm and rotary embeddings out of elementwise ops, so the edge
graph holds them as chains (RMSNorm: pow → mean → add(eps) → rsqrt → mul → mul(weight)).
On MLX's CPU each op is a pass over memory, so one fused op per chain saves most of that
work. A pattern matches only when it computes exactly the fused op's math: fixed
exponents and dims, one dtype throughout (no casts inside), and every inner node read by
the chain alone (its value is never needed elsewhere).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from .graph_builder import Builder, ep_constant, node_args, norm_dim, target_key, value_of

aten = torch.ops.aten


LowerFn = Callable[[Builder, Node], None]


@dataclass(frozen=True)
class Fusion:
    """One matched chain: ``lower`` emits the fused op for the chain's last node (its root);
    ``absorbed`` are the chain's other nodes, whose work the fused op does."""

    lower: LowerFn
    absorbed: frozenset[Node]


@dataclass(frozen=True)
class Fusions:
    """The fusions of one graph: how each root lowers, and the nodes not lowered on their own
    (every chain's inner nodes, and constant placeholders only they read, like an eps)."""

    roots: dict[Node, LowerFn]
    absorbed: frozenset[Node]


def find_fusions(ep: ExportedProgram) -> Fusions:
    """Every fusable chain of ``ep``'s graph (chains never overlap)."""
    roots: dict[Node, LowerFn] = {}
    absorbed: set[Node] = set()
    for node in ep.graph.nodes:
        for match in _MATCHERS:
            fusion = match(ep, node)
            if fusion is not None and not fusion.absorbed & (absorbed | roots.keys()):
                roots[node] = fusion.lower
                absorbed |= fusion.absorbed
                break
    constants = [
        n for n in ep.graph.nodes
        if n.op == "placeholder" and n.users and set(n.users) <= absorbed and ep_constant(ep, n) is not None
    ]  # fmt: skip
    return Fusions(roots, frozenset(absorbed.union(constants)))


# -- matching helpers ------------------------------------------------------------------
def _call(x: Any, *targets: Any) -> bool:
    return isinstance(x, Node) and x.op == "call_function" and target_key(x.target) in targets


def _only_read_by(node: Node, user: Node) -> bool:
    return list(node.users) == [user]


def _dtype(x: Any) -> Optional[torch.dtype]:
    v = value_of(x)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _same_dtype(nodes: list[Node]) -> bool:
    dtypes = {_dtype(n) for n in nodes}
    return len(dtypes) == 1 and next(iter(dtypes)) in (torch.float32, torch.float16, torch.bfloat16)


def _last_dim(x: Node) -> Optional[int]:
    """``x``'s static last-dim size (None when dynamic or x is 0-d)."""
    shape = value_of(x).shape
    return shape[-1] if shape and isinstance(shape[-1], int) else None


def _operands(node: Node) -> tuple[Any, Any]:
    return node.args[0], node.args[1]


def _plain_add(node: Node) -> bool:
    return _call(node, aten.add.Tensor) and node_args(node).get("alpha", 1) == 1


def _scalar_value(ep: ExportedProgram, x: Any) -> Optional[float]:
    """``x`` as a Python float when it is a number or a 0-d constant tensor."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    tensor = ep_constant(ep, x) if isinstance(x, Node) else None
    return float(tensor.item()) if tensor is not None and tensor.dim() == 0 else None


# -- RMSNorm ---------------------------------------------------------------------------
def _match_rms_norm(ep: ExportedProgram, root: Node) -> Optional[Fusion]:
    """``weight * (x * rsqrt(mean(x**2, -1, keepdim) + eps))`` → ``rms_norm(x, weight, eps)``."""
    if not _call(root, aten.mul.Tensor):
        return None
    for weight, normed in (_operands(root), _operands(root)[::-1]):
        if not _call(normed, aten.mul.Tensor) or not isinstance(weight, Node):
            continue
        for x, rsqrt in (_operands(normed), _operands(normed)[::-1]):
            fusion = _rms_chain(ep, root, weight, normed, x, rsqrt)
            if fusion is not None:
                return fusion
    return None


def _rms_chain(ep: ExportedProgram, root: Node, weight: Node, normed: Node, x: Any, rsqrt: Any) -> Optional[Fusion]:
    if not (isinstance(x, Node) and _call(rsqrt, aten.rsqrt.default) and _plain_add(rsqrt.args[0])):
        return None
    shifted = rsqrt.args[0]
    for mean, eps_arg in (_operands(shifted), _operands(shifted)[::-1]):
        eps = _scalar_value(ep, eps_arg)
        if eps is None or not _call(mean, aten.mean.dim):
            continue
        args = node_args(mean)
        square = args["self"]
        rank = value_of(x).dim()
        dims = args["dim"]
        if not (
            _call(square, aten.pow.Tensor_Scalar) and square.args[0] is x and square.args[1] == 2
            and args["keepdim"] and dims is not None and len(dims) == 1 and norm_dim(dims[0], rank) == rank - 1
            and args.get("dtype") is None
        ):  # fmt: skip
            continue
        size = _last_dim(x)
        chain = [square, mean, shifted, rsqrt, normed]
        users = [mean, shifted, rsqrt, normed, root]
        if (
            size is None or tuple(value_of(weight).shape) != (size,)
            or not _same_dtype([x, weight, *chain, root])
            or not all(_only_read_by(n, u) for n, u in zip(chain, users))
        ):  # fmt: skip
            return None

        def lower(b: Builder, node: Node, eps: float = eps) -> None:
            b.emit_node(node, "rms_norm", (b.slots[x], b.slots[weight]), {"eps": eps})

        return Fusion(lower, frozenset(chain))
    return None


# -- rotary embedding ------------------------------------------------------------------
def _match_rope(ep: ExportedProgram, root: Node) -> Optional[Fusion]:
    """``x * cos + cat(-x[..., d/2:], x[..., :d/2]) * sin`` → ``rope_half(x, cos, sin)``
    (HF's ``apply_rotary_pos_emb`` with ``rotate_half``)."""
    if not _plain_add(root):
        return None
    for direct, rotated in (_operands(root), _operands(root)[::-1]):
        if not (_call(direct, aten.mul.Tensor) and _call(rotated, aten.mul.Tensor)):
            continue
        for rot, sin in (_operands(rotated), _operands(rotated)[::-1]):
            fusion = _rope_chain(root, direct, rotated, rot, sin)
            if fusion is not None:
                return fusion
    return None


def _half_slice(node: Any, x: Node, start: int, end_at_least: int, half: int) -> bool:
    """``node`` is ``x[..., start:end]`` along the last dim, step 1, covering ``half`` items."""
    if not _call(node, aten.slice_copy.Tensor):
        return False
    args = node_args(node)
    rank = value_of(x).dim()
    end = args["end"]
    return (
        args["self"] is x and norm_dim(args["dim"], rank) == rank - 1 and args["step"] == 1
        and (args["start"] or 0) == start and isinstance(end, int) and end >= end_at_least
        and value_of(node).shape[-1] == half
    )  # fmt: skip


def _rope_chain(root: Node, direct: Node, rotated: Node, rot: Any, sin: Any) -> Optional[Fusion]:
    if not (_call(rot, aten.cat.default) and isinstance(sin, Node)):
        return None
    tensors, dim = node_args(rot)["tensors"], node_args(rot)["dim"]
    if len(tensors) != 2 or not _call(tensors[0], aten.neg.default):
        return None
    neg, low = tensors
    high = neg.args[0]
    x = low.args[0] if _call(low, aten.slice_copy.Tensor) else None
    size = _last_dim(x) if isinstance(x, Node) else None
    if size is None or size % 2 or norm_dim(dim, value_of(rot).dim()) != value_of(rot).dim() - 1:
        return None
    half = size // 2
    if not (_half_slice(low, x, 0, half, half) and _half_slice(high, x, half, size, half)):
        return None
    a, c = _operands(direct)
    if a is not x and c is not x:
        return None
    cos = c if a is x else a
    chain = [high, neg, low, rot, direct, rotated]
    users = [neg, rot, rot, rotated, root, root]
    if (
        not isinstance(cos, Node)
        or value_of(root).shape != value_of(x).shape
        or not _same_dtype([x, cos, sin, *chain, root])
        or not all(_only_read_by(n, u) for n, u in zip(chain, users))
    ):  # fmt: skip
        return None

    def lower(b: Builder, node: Node) -> None:
        b.emit_node(node, "rope_half", (b.slots[x], b.slots[cos], b.slots[sin]))

    return Fusion(lower, frozenset(chain))


_MATCHERS: tuple[Callable[[ExportedProgram, Node], Optional[Fusion]], ...] = (_match_rms_norm, _match_rope)
