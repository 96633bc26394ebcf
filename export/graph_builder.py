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

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}

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


def ep_constant(ep: ExportedProgram, node: Node) -> Optional[torch.Tensor]:
    """The tensor behind a parameter, buffer or lifted-constant placeholder of ``ep``
    (None for any other node)."""
    spec = next((s for s in ep.graph_signature.input_specs if s.arg.name == node.name), None)
    if node.op != "placeholder" or spec is None or spec.kind not in _CONSTANT_KINDS:
        return None
    return ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]


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
        self.constants: dict[int, np.ndarray] = {}
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
        flat = tensor.detach().contiguous().reshape(-1)
        return self.add_constant_bytes(name, self.tensor_type(tensor), flat.view(torch.uint8).numpy())

    def add_constant_bytes(self, name: str, type: TensorType, data: np.ndarray) -> int:
        """A constant slot of ``type`` holding ``data``'s C-order bytes (sized for the type)."""
        slot = self.graph.add_slot(name, SlotKind.CONSTANT, type)
        self.constants[slot] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
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
            value = ep_constant(self.ep, arg)
            if value is not None:
                self._casts[slot, name] = self.add_constant(f"{self.graph.slots[slot].name}.{name}", value.to(dtype))
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
