"""Lowerings of a mixture-of-experts block's ops into the table of ``op_lowerings``: the
router's ``aten.topk`` and the routed ``llm::experts`` (see ``ir.catalog_moe``)."""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Node

from mlx_pte.ir.catalog_moe import CLAMPED_SWIGLU

from . import experts_op  # noqa: F401  (defines torch.ops.llm.experts)
from .errors import ExportError
from .graph_builder import Builder, node_args, norm_dim, rank_of, value_of
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
    routed = tuple(b.slots[args[k]] for k in ("x", "indices", "weights"))
    attrs = {"activation": str(args["activation"])}
    if attrs["activation"] == CLAMPED_SWIGLU:
        attrs.update(alpha=float(args["alpha"]), limit=float(args["limit"]))
    # The biases are appended only when present, so other families' programs are unchanged.
    biases = tuple(b.slots[args[k]] for k in ("gate_up_bias", "down_bias") if args.get(k) is not None)
    gate_up, down = args["gate_up"], args["down"]
    if gate_up in b.quantized and down in b.quantized:
        (spec, *gate_up_parts), (down_spec, *down_parts) = b.quantized[gate_up], b.quantized[down]
        assert spec == down_spec  # one export quantizes every weight to one type
        b.emit_node(node, "quantized_experts", (*routed, *gate_up_parts, *down_parts, *biases),
                    {**attrs, **spec.to_dict()})  # fmt: skip
        return
    if gate_up in b.quantized or down in b.quantized:
        raise ExportError(
            f"{node.name}: the quantization's groups divide only one of the experts' widths "
            f"(gate_up {tuple(value_of(gate_up).shape)}, down {tuple(value_of(down).shape)}); "
            "choose a --group-size that divides both the hidden and the expert intermediate size"
        )
    b.emit_node(node, "experts", (*routed, b.slots[gate_up], b.slots[down], *biases), attrs)


_register(torch.ops.llm.experts.default, _experts)
