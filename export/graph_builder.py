"""Building an IR graph from FX nodes: the node → slot map, typed slots, casts, scalar
constants and dynamic sizes, shared by every lowering in ``op_lowerings``."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import numpy as np
import sympy
import torch
from executorch.exir.dialects.edge._ops import EdgeOpOverload
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Node
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

from mlx_pte.ir.catalog import lookup
from mlx_pte.ir.graph import Dim, Graph, Instruction, ScalarType, SlotKind, SlotRef, SymDim, TensorType
from mlx_pte.ir.quantization import QuantSpec

from .tensor_source import DTYPE_NAMES, ArraySource, CastSource, TensorSource
from .weight_writer import ConstantData, active_sink

Size = Union[int, SlotRef]
_CONSTANT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
DimRange = tuple[int, Optional[int]]  # (min, max); max None = unbounded


def range_bounds(r: ValueRanges) -> DimRange:
    """A sympy range as ints (sizes are never negative; an infinite max is None)."""
    lower = 0 if r.lower in (-int_oo, -sympy.oo) else max(int(r.lower), 0)
    upper = None if r.upper in (int_oo, sympy.oo) else int(r.upper)
    return lower, upper


def override_range(r: ValueRanges, user: Optional[DimRange]) -> ValueRanges:
    """``user``'s range where one is given, else ``r``."""
    if user is None:
        return r
    lower, upper = user
    return ValueRanges(lower, int_oo if upper is None else upper)


def target_key(target: Any) -> Any:
    """The aten overload behind an edge op (edge ops wrap it as ``_op``)."""
    return target._op if isinstance(target, EdgeOpOverload) else target


def target_name(target: Any) -> str:
    key = target_key(target)
    return str(key) if isinstance(key, torch._ops.OpOverload) else getattr(key, "__name__", str(key))


def node_args(node: Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in."""
    schema = target_key(node.target)._schema
    values: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            values[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            values[arg.name] = node.kwargs[arg.name]
        else:
            values[arg.name] = arg.default_value if arg.has_default_value() else None
    return values


def value_of(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, Node) else arg


def rank_of(arg: Node) -> int:
    return value_of(arg).dim()


def norm_dim(dim: int, rank: int) -> int:
    return dim % rank if rank else 0


def constant_source(ep: ExportedProgram, node: Node) -> Optional[TensorSource]:
    """Where the value of a parameter, buffer or lifted-constant placeholder of ``ep``
    comes from: the streamed checkpoint tensor when the export streams it
    (``weight_writer``), else the program's own tensor (None for any other node)."""
    spec = next((s for s in ep.graph_signature.input_specs if s.arg.name == node.name), None)
    if node.op != "placeholder" or spec is None or spec.kind not in _CONSTANT_KINDS:
        return None
    streamed = active_sink().sources.get(spec.target)
    if streamed is not None:
        return streamed
    return ArraySource(ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target])


def ep_constant(ep: ExportedProgram, node: Node) -> Optional[torch.Tensor]:
    """The value behind a constant placeholder of ``ep`` (None for any other node); a
    streamed weight is read, so callers ask only for values they fold (norm weights,
    scalars)."""
    source = constant_source(ep, node)
    return None if source is None else source.tensor()


def is_number(x: Any) -> bool:
    return isinstance(x, (bool, int, float))


def is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


class Builder:
    """Builds one IR graph from one edge program; holds the node → slot map."""

    def __init__(self, ep: ExportedProgram, dim_ranges: Mapping[str, DimRange]) -> None:
        self.ep = ep
        self.ranges = {sym: override_range(r, dim_ranges.get(str(sym))) for sym, r in ep.range_constraints.items()}
        self.graph = Graph()
        self.constants: dict[int, ConstantData] = {}
        self.slots: dict[Node, Union[int, tuple[int, ...]]] = {}
        # quantized weight placeholder -> (QuantSpec, weight, scales, biases or None) slots
        # (filled by ``export.quantize.add_quantized``)
        self.quantized: dict[Node, tuple[QuantSpec, int, int, Optional[int]]] = {}
        self._casts: dict[tuple[int, str], int] = {}
        self._scalars: dict[tuple[str, float], int] = {}
        self._sizes: dict[tuple[int, int], int] = {}

    # -- types --------------------------------------------------------------------
    def dim(self, d: Union[int, torch.SymInt]) -> Dim:
        if isinstance(d, int):
            return d
        expr = d.node.expr
        if expr.is_number:
            return int(expr)
        return SymDim(str(expr), *range_bounds(bound_sympy(expr, self.ranges)))

    def tensor_type(self, val: torch.Tensor) -> TensorType:
        return TensorType(DTYPE_NAMES[val.dtype], tuple(self.dim(d) for d in val.shape))

    def slot_type(self, slot: int) -> TensorType:
        return self.graph.slots[slot].type  # type: ignore[return-value]

    # -- slots --------------------------------------------------------------------
    def add_constant(self, name: str, tensor: torch.Tensor) -> int:
        return self.add_source(name, ArraySource(tensor))

    def add_source(self, name: str, source: TensorSource) -> int:
        """A constant slot holding ``source``'s value, read when the payload is written."""
        return self.add_constant_bytes(name, TensorType(source.dtype, tuple(source.shape)), source)

    def add_constant_bytes(self, name: str, type: TensorType, data: ConstantData) -> int:
        """A constant slot of ``type`` holding ``data``'s C-order bytes (sized for the type),
        or a source producing them."""
        slot = self.graph.add_slot(name, SlotKind.CONSTANT, type)
        self.constants[slot] = np.ascontiguousarray(data).reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else data
        return slot

    def emit(self, op: str, inputs: tuple, attrs: dict[str, Any], name: str, types: list) -> list[int]:
        outs = [self.graph.add_slot(f"{name}" if len(types) == 1 else f"{name}.{i}", SlotKind.TEMP, t)
                for i, t in enumerate(types)]  # fmt: skip
        instr = Instruction(op, tuple(inputs), tuple(outs), tuple(attrs.items()))
        lookup(op).validate(instr, self.graph)
        self.graph.instructions.append(instr)
        return outs

    def emit_node(self, node: Node, op: str, inputs: tuple, attrs: Optional[dict[str, Any]] = None) -> int:
        """Emit ``op`` producing ``node``'s single tensor result."""
        (slot,) = self.emit(op, inputs, attrs or {}, node.name, [self.tensor_type(node.meta["val"])])
        self.slots[node] = slot
        return slot

    def scalar_slot_op(self, node: Node, op: str, attrs: dict[str, Any], inputs: tuple = ()) -> None:
        (self.slots[node],) = self.emit(op, inputs, attrs, node.name, [ScalarType("int")])

    # -- operands -----------------------------------------------------------------
    def operand(self, arg: Any, dtype: torch.dtype) -> int:
        """``arg`` (a node or a Python number) as a slot of ``dtype``, cast if needed."""
        name = DTYPE_NAMES[dtype]
        if not isinstance(arg, Node):
            return self.scalar_constant(arg, name)
        slot = self.slots[arg]
        assert isinstance(slot, int)
        if self.slot_type(slot).dtype == name:
            return slot
        if (slot, name) not in self._casts and self.graph.slots[slot].kind is SlotKind.CONSTANT:
            # A constant is converted here once (torch rounds as MLX's astype does), not per run.
            source = constant_source(self.ep, arg)
            if source is not None:
                self._casts[slot, name] = self.add_source(f"{self.graph.slots[slot].name}.{name}", CastSource(source, name))
        if (slot, name) not in self._casts:
            src = self.slot_type(slot)
            (self._casts[slot, name],) = self.emit(
                "cast", (slot,), {"dtype": name}, f"{self.graph.slots[slot].name}.{name}",
                [TensorType(name, src.shape)],
            )  # fmt: skip
        return self._casts[slot, name]

    def scalar_constant(self, value: Union[bool, int, float], dtype: str) -> int:
        key = (dtype, value)
        if key not in self._scalars:
            torch_dtype = next(t for t, n in DTYPE_NAMES.items() if n == dtype)
            self._scalars[key] = self.add_constant(f"_scalar_{dtype}_{value}", torch.tensor(value, dtype=torch_dtype))
        return self._scalars[key]

    def size(self, x: Any) -> Size:
        """An int, or a SlotRef to the scalar slot of a symbolic-int node."""
        if isinstance(x, Node):
            slot = self.slots[x]
            assert isinstance(slot, int)
            return SlotRef(slot)
        return int(x)

    def sizes(self, xs: Any) -> tuple[Size, ...]:
        return tuple(self.size(x) for x in xs)

    def shape_of(self, arg: Node) -> tuple[Size, ...]:
        """``arg``'s shape, with a ``sym_size`` read for each dynamic dim."""
        slot = self.slots[arg]
        assert isinstance(slot, int)
        shape: list[Size] = []
        for i, d in enumerate(self.slot_type(slot).shape):
            if isinstance(d, int):
                shape.append(d)
                continue
            if (slot, i) not in self._sizes:
                (self._sizes[slot, i],) = self.emit(
                    "sym_size", (slot,), {"dim": i}, f"{self.graph.slots[slot].name}.size{i}", [ScalarType("int")]
                )
            shape.append(SlotRef(self._sizes[slot, i]))
        return tuple(shape)
