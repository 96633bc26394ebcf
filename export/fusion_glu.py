"""Gated MLPs: ``act(gate) * up`` → one ``glu`` (SwiGLU for Llama-family models, GeGLU
for Gemma), so the activation and the product run as one compiled kernel.

torch computes a half-precision activation in fp32 and rounds once, then multiplies in
the tensors' dtype; ``glu`` does the same. The gate and up projections stay ordinary
``linear`` instructions.
"""
from __future__ import annotations

from typing import Optional

from torch.export import ExportedProgram
from torch.fx import Node

from .fusion_match import Fusion, aten, both_orders, is_call, only_read_by, same_float_dtype, shape_of
from .graph_builder import Builder, node_args


def _activation(node: object) -> Optional[str]:
    if is_call(node, aten.silu.default):
        return "silu"
    if is_call(node, aten.gelu.default):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(node_args(node)["approximate"])  # type: ignore[arg-type]
    return None


def match_glu(ep: ExportedProgram, root: Node) -> Optional[Fusion]:
    if not is_call(root, aten.mul.Tensor):
        return None
    for act, up in both_orders(root):
        name = _activation(act)
        if name is None or not isinstance(up, Node) or up is act:
            continue
        gate = act.args[0]
        if (
            isinstance(gate, Node) and only_read_by(act, root)
            and shape_of(gate) == shape_of(up) == shape_of(root) and same_float_dtype([gate, up, act, root])
        ):  # fmt: skip

            def lower(b: Builder, node: Node, gate: Node = gate, up: Node = up, name: str = name) -> None:
                b.emit_node(node, "glu", (b.slots[gate], b.slots[up]), {"activation": name})

            return Fusion(lower, frozenset({act}))
    return None
