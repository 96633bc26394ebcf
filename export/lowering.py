"""Lower an edge-dialect ExportedProgram to the IR graph (``ir.graph``) and its constants,
and decide which nodes can be lowered (the op table is ``op_lowerings``)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Node

from mlx_pte.ir.graph import Graph, SlotKind, TensorType
from mlx_pte.ir.quantization import QuantSpec
from mlx_pte.ir.fuse_projections import fuse_projections
from mlx_pte.ir.passes import simplify

from .errors import ExportError
from .fusion import find_fusions
from .graph_builder import (
    DTYPE_NAMES,
    Builder,
    DimRange,
    constant_source,
    is_tensor,
    range_bounds,
    target_key,
    target_name,
    value_of,
)
from .op_lowerings import LOWERINGS
from .quantize import add_quantized, plan_quantization
from .tensor_source import concat_sources


def dim_ranges(ep: ExportedProgram) -> dict[str, DimRange]:
    """The user's dynamic-dim ranges of an ATen program, by symbol name (max None = unbounded).

    ``to_edge`` narrows a range declared from 1 to start at 2 (torch's 0/1
    specialisation); the export keeps the user's ranges to restore them in the payload.
    """
    return {str(sym): range_bounds(r) for sym, r in ep.range_constraints.items()}


def _tensors_of(node: Node) -> list[torch.Tensor]:
    vals: list[Any] = [node.meta.get("val")]
    vals += [value_of(a) for a in node.all_input_nodes]
    flat: list[torch.Tensor] = []
    for v in vals:
        flat.extend(x for x in (v if isinstance(v, (list, tuple)) else (v,)) if is_tensor(x))
    return flat


def unsupported_reason(node: Node) -> Optional[str]:
    """None if ``node`` lowers, else the op's name with the reason (for the error listing)."""
    name = target_name(node.target)
    lowering = LOWERINGS.get(target_key(node.target))
    if lowering is None:
        return name
    bad = sorted({str(t.dtype) for t in _tensors_of(node) if t.dtype not in DTYPE_NAMES})
    if bad:
        return f"{name} ({', '.join(bad)})"
    reason = lowering.check(node) if lowering.check else None
    return f"{name} ({reason})" if reason else None


@dataclass(frozen=True)
class Signature:
    """What ``preprocess`` cannot see in the delegated program.

    ExecuTorch hands the delegate its inputs in first-use order and narrows dynamic
    ranges (see ``dim_ranges``), so the program's own input and output order (edge node
    names) and the user's ranges travel with it.
    """

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dim_ranges: Mapping[str, DimRange]

    def to_json(self) -> bytes:
        return json.dumps({"inputs": self.inputs, "outputs": self.outputs, "dim_ranges": self.dim_ranges}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Signature":
        d = json.loads(raw)
        ranges = {name: (lo, hi) for name, (lo, hi) in d["dim_ranges"].items()}
        return cls(tuple(d["inputs"]), tuple(d["outputs"]), ranges)


def lower_program(
    ep: ExportedProgram,
    signature: Signature,
    quantization: Optional[QuantSpec] = None,
    fused_projections: bool = True,
) -> tuple[Graph, dict[int, np.ndarray]]:
    """Lower every node of ``ep`` (an edge program the partitioner accepted).

    Args:
        ep: the edge program.
        signature: its input/output order and dynamic ranges.
        quantization: quantize linear and embedding weights to this type
            (``export.quantize``); None keeps every weight as it is.
        fused_projections: fuse the linears that read one input (q/k/v, gate/up) into one
            matmul and a split (``ir.fuse_projections``); False keeps one matmul each.

    Returns:
        The graph (fused at lowering, projections fused, then simplified: ``ir.passes``)
        and its constants:
        slot → the constant's raw bytes (uint8, row-major).

    Raises:
        ExportError: an input the program never reads, or an output that is not a
            tensor the program computes.
    """
    b = Builder(ep, signature.dim_ranges)
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
    fusions = find_fusions(ep)
    packed = plan_quantization(ep, quantization, fusions.absorbed)
    for node in ep.graph.nodes:
        if node in fusions.absorbed:
            continue
        if node in packed:
            add_quantized(b, node, specs[node.name].target, packed[node])
        elif node.op == "placeholder":
            _lower_placeholder(b, node, specs[node.name])
        elif node.op == "call_function":
            fusions.roots.get(node, LOWERINGS[target_key(node.target)].fn)(b, node)
    by_name = {node.name: slot for node, slot in b.slots.items() if isinstance(slot, int)}
    inputs = {b.graph.slots[s].name: s for s in b.graph.inputs}
    unused = [name for name in signature.inputs if name not in inputs]
    if unused:
        raise ExportError(f"forward() never reads its inputs {unused}; remove them")
    b.graph.inputs = [inputs[name] for name in signature.inputs]
    for i, name in enumerate(signature.outputs):
        if name not in by_name or not isinstance(b.graph.slots[by_name[name]].type, TensorType):
            raise ExportError(f"output {i} ({name}) is not a tensor computed by forward(); return computed tensors only")
        b.graph.outputs.append(by_name[name])
    graph, constants = fuse_projections(b.graph, b.constants, concat_sources) if fused_projections else (b.graph, b.constants)
    return simplify(graph, constants)


def _lower_placeholder(b: Builder, node: Node, spec: Any) -> None:
    val = node.meta.get("val")
    if spec.kind is InputKind.USER_INPUT:
        if not is_tensor(val):
            raise ExportError(f"input {node.name!r} is a {type(val).__name__}; pass tensors only")
        slot = b.graph.add_slot(node.name, SlotKind.INPUT, b.tensor_type(val))
        b.graph.inputs.append(slot)
        b.slots[node] = slot
        return
    if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
        raise ExportError(f"input {node.name!r} of kind {spec.kind.name} cannot be lowered")
    if not node.users:
        return
    source = constant_source(b.ep, node)
    assert source is not None  # a constant kind, checked above
    b.slots[node] = b.add_source(spec.target, source)
