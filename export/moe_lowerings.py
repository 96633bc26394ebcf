"""Lowerings of a mixture-of-experts block's ops into the table of ``op_lowerings``: the
router's ``aten.topk`` and the routed ``llm::experts`` (see ``ir.catalog_moe``)."""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Node

from . import experts_op  # noqa: F401  (defines torch.ops.llm.experts)
from .graph_builder import Builder, node_args, norm_dim, rank_of
from .op_lowerings import _register


def _topk(b: Builder, node: Node) -> None:
    args = node_args(node)
    x = args["self"]
    attrs = {"k": int(args["k"]), "dim": norm_dim(args.get("dim", -1), rank_of(x)),
             "largest": bool(args.get("largest", True))}  # fmt: skip
    b.slots[node] = tuple(b.emit("topk", (b.slots[x],), attrs, node.name,
                                 [b.tensor_type(v) for v in node.meta["val"]]))  # fmt: skip


def _check_topk(node: Node) -> Optional[str]:
    args = node_args(node)
    if not isinstance(args["k"], int):
        return "a symbolic k"
    # An unsorted topk leaves the order to the kernel; only torch's sorted order is defined.
    return None if args.get("sorted", True) else "sorted=False"


_register(torch.ops.aten.topk.default, _topk, _check_topk)


def _experts(b: Builder, node: Node) -> None:
    args = node_args(node)
    b.emit_node(
        node, "experts",
        tuple(b.slots[args[k]] for k in ("x", "indices", "weights", "gate_up", "down")),
        {"activation": str(args["activation"])},
    )  # fmt: skip


_register(torch.ops.llm.experts.default, _experts)
