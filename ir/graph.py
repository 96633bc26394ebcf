"""The in-memory graph IR shared by the exporter (which builds it) and the interpreter
(which runs it).

A graph is a flat list of slots and a list of instructions in execution order. A slot
holds a tensor or a scalar (a symbolic int such as a dynamic dim's size, computed at run
time). Every slot is written once: by the caller (inputs), by the loader (constants), or
by exactly one instruction (temps and outputs). Instructions name their op, which must be
in the op catalog (``ir.catalog``), their operand and result slots, and typed attributes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional, Union

# Dtype names, as numpy/MLX spell them.
DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool", "uint32")


class SlotKind(str, Enum):
    INPUT = "input"  # written by the caller, in ``Graph.inputs`` order
    CONSTANT = "constant"  # a weight, bytes in the payload's data segment
    TEMP = "temp"  # written by one instruction


@dataclass(frozen=True)
class SymDim:
    """A dynamic dimension: its name (shared by every slot with the same symbol) and range."""

    name: str
    min: int
    max: Optional[int]  # None = unbounded


Dim = Union[int, SymDim]


@dataclass(frozen=True)
class TensorType:
    """A tensor's dtype and shape. Both are None only for a temp whose file records no type
    (an imported upstream program types its inputs, outputs and constants, not its temps)."""

    dtype: Optional[str]
    shape: Optional[tuple[Dim, ...]]


UNTYPED_TENSOR = TensorType(None, None)


@dataclass(frozen=True)
class ScalarType:
    """A host scalar: a symbolic int (``"int"``), float or bool."""

    kind: str  # "int" | "float" | "bool"


@dataclass(frozen=True)
class Slot:
    name: str
    kind: SlotKind
    type: Union[TensorType, ScalarType]


@dataclass(frozen=True)
class SlotRef:
    """An attribute value read from a scalar slot at run time (e.g. a dynamic size)."""

    slot: int


# Attribute values: literals, dtype names (str), scalar-slot references, and lists of
# ints/floats/refs (e.g. a view shape with one dynamic entry).
AttrValue = Union[None, bool, int, float, str, SlotRef, tuple[Union[int, float, SlotRef], ...]]


@dataclass(frozen=True)
class Instruction:
    op: str
    inputs: tuple[Optional[int], ...]  # operand slots; None = an omitted optional operand
    outputs: tuple[int, ...]
    attrs: tuple[tuple[str, AttrValue], ...] = ()

    def attr(self, name: str, default: AttrValue = None) -> AttrValue:
        for key, value in self.attrs:
            if key == name:
                return value
        return default


@dataclass(frozen=True)
class Constant:
    """Where a constant slot's bytes live in the payload's data segment."""

    slot: int
    offset: int
    nbytes: int


@dataclass
class Graph:
    slots: list[Slot] = field(default_factory=list)
    instructions: list[Instruction] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)

    def add_slot(self, name: str, kind: SlotKind, type: Union[TensorType, ScalarType]) -> int:
        self.slots.append(Slot(name, kind, type))
        return len(self.slots) - 1

    def constants(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.kind is SlotKind.CONSTANT]
