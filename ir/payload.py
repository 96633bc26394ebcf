"""The MLXPteBackend delegate payload: one blob holding the graph, the manifest and every
weight, so a single .pte file runs on its own.

Layout (little-endian; offsets from the start of the payload)::

    0    magic b"MLXP"
    4    u32   format version
    8    u64   graph offset, graph size,
               manifest offset, manifest size,
               data offset, data size
    56   u32   CRC-32 of bytes [0, 56), the graph and the manifest
    60   u32   reserved, 0
    64   graph: a FlatBuffer (schemas/mlx_graph.fbs)
         manifest: a JSON object, UTF-8
         zero padding to a multiple of 64
         data: the weight segment, each constant at a multiple of 64

Version 2 moves the weight segment out of the payload into the program's named data
(entry ``WEIGHTS_KEY``, aligned to a page), so the exporter streams weights into the file
instead of building the payload in memory: its header's data offset is 0 and its data size
is the entry's; everything else is as in version 1, which readers still accept (and
``encode_payload`` still writes, for programs small enough to build in memory).

The checksum lets a reader reject a damaged graph or manifest before trusting them; the
weight segment is not summed, so loading never has to read every weight. A reader
refuses any version newer than its own before reading past the version field, which
leaves a later version free to change everything after it.

This module holds the format (its constants and codes), ``Payload`` and the validation
both directions share; ``payload_write`` encodes and ``payload_read`` decodes, and their
entry points are importable from here.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Union

import numpy as np

from mlx_pte.schemas import mlx_graph_generated as fb

from .catalog import validate_graph
from .errors import FormatError
from .quantization import quantized_constants
from .graph import (
    DTYPES,
    Constant,
    Graph,
    Instruction,
    ScalarType,
    Slot,
    SlotKind,
    SlotRef,
    SymDim,
    TensorType,
    UNTYPED_TENSOR,
)

FORMAT_VERSION: int = 2
INLINE_VERSION = 1  # the weights inside the payload
WEIGHTS_KEY = "mlx_pte.weights"  # version 2: the named data entry holding the weights
WEIGHTS_ALIGNMENT = 4096  # of that entry in the file, so it can be mapped page by page
MAGIC = b"MLXP"
ALIGNMENT = 64  # of the weight segment and of each constant in it

PREFIX = struct.Struct("<4sI")  # magic, version: all a reader may assume of any version
HEADER = struct.Struct("<4sI6QII")
CRC_START = HEADER.size - 8  # the CRC field; the header bytes before it are summed

ITEMSIZE = {
    "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "uint32": 4,
}  # fmt: skip

ConstantBytes = Union[bytes, bytearray, memoryview, np.ndarray]

# IR names <-> schema enum codes. The schema's enum members are named like the IR
# values, so each table is derived rather than listed twice.
DTYPE_CODE = {name: getattr(fb.DType, name) for name in DTYPES}
SLOT_KIND_CODE = {kind: getattr(fb.SlotKind, kind.value) for kind in SlotKind}
VALUE_TYPE_CODE = {name: getattr(fb.ValueType, name) for name in ("tensor", "int", "float", "bool")}
DTYPE_NAME = {code: name for name, code in DTYPE_CODE.items()}
SLOT_KIND = {code: kind for kind, code in SLOT_KIND_CODE.items()}
VALUE_TYPE = {code: name for name, code in VALUE_TYPE_CODE.items()}
ATTR_KIND = fb.AttrKind


@dataclass(frozen=True)
class Payload:
    """A decoded payload. ``data`` and every constant's bytes are views into the blob."""

    graph: Graph
    manifest: dict  # JSON object
    constants: Mapping[int, Constant]  # constant slot -> where its bytes are in ``data``
    data: memoryview  # the aligned weight segment
    # Drops a constant's bytes from this process once the loader has copied them (set by
    # ``pte.read_pte`` for a mapped file: its pages would otherwise stay resident too).
    release: Optional[Callable[[memoryview], None]] = None

    def constant_bytes(self, slot: int) -> memoryview:
        """The bytes of constant ``slot`` (no copy). KeyError if it is not a constant."""
        c = self.constants[slot]
        return self.data[c.offset : c.offset + c.nbytes]


# -- validation, shared by encode and decode ------------------------------------------


def check_graph(graph: Graph) -> None:
    """Raise FormatError unless ``graph`` is well formed.

    Checks slot types, the input and output lists, every instruction against the op
    catalog, the quantized weights (``ir.quantization``), and dataflow: an instruction reads only slots already written (inputs,
    constants, earlier results) and writes only temps, each at most once.
    """
    for index, slot in enumerate(graph.slots):
        _check_slot(index, slot)
    n = len(graph.slots)
    listed = set()
    for s in graph.inputs:
        if not 0 <= s < n or graph.slots[s].kind is not SlotKind.INPUT:
            raise FormatError(f"graph input {s} is not an input slot")
        if s in listed:
            raise FormatError(f"graph input {s} is listed twice")
        listed.add(s)
    for s, slot in enumerate(graph.slots):
        if slot.kind is SlotKind.INPUT and s not in listed:
            raise FormatError(f"input slot {s} ({slot.name!r}) is missing from the graph's inputs")
    for s in graph.outputs:
        if not 0 <= s < n:
            raise FormatError(f"graph output {s} refers to a slot that does not exist")
    validate_graph(graph)
    quantized_constants(graph)  # one packed weight is one quantized weight to all its readers
    _check_dataflow(graph)


def _check_slot(index: int, slot: Slot) -> None:
    where = f"slot {index} ({slot.name!r})"
    if not isinstance(slot.kind, SlotKind):
        raise FormatError(f"{where} has unknown kind {slot.kind!r}")
    t = slot.type
    if t == UNTYPED_TENSOR:
        if slot.kind is not SlotKind.TEMP:
            raise FormatError(f"{where}: only a temp may leave its dtype and shape unrecorded")
    elif isinstance(t, TensorType):
        if t.dtype not in DTYPE_CODE:
            raise FormatError(f"{where} has unknown dtype {t.dtype!r}")
        for d in t.shape:
            if isinstance(d, SymDim):
                if d.min < 0 or (d.max is not None and d.max < d.min):
                    raise FormatError(
                        f"{where}: dynamic dim {d.name!r} has an empty range [{d.min}, {d.max}]"
                    )
            elif isinstance(d, bool) or not isinstance(d, int) or d < 0:
                raise FormatError(f"{where}: dim {d!r} is not a size")
    elif isinstance(t, ScalarType):
        if t.kind not in VALUE_TYPE_CODE or t.kind == "tensor":
            raise FormatError(f"{where} has unknown scalar kind {t.kind!r}")
        if slot.kind is SlotKind.CONSTANT:
            raise FormatError(f"{where}: a constant must be a tensor")
    else:
        raise FormatError(f"{where} has no tensor or scalar type")


def _slot_refs(instr: Instruction) -> list[int]:
    refs = []
    for _, value in instr.attrs:
        items = value if isinstance(value, tuple) else (value,)
        refs.extend(v.slot for v in items if isinstance(v, SlotRef))
    return refs


def _check_dataflow(graph: Graph) -> None:
    written = set(graph.inputs) | set(graph.constants())
    for n, instr in enumerate(graph.instructions):
        where = f"instruction {n} ({instr.op!r})"
        for s in [s for s in instr.inputs if s is not None] + _slot_refs(instr):
            if s not in written:
                raise FormatError(f"{where} reads slot {s} before anything writes it")
        for s in instr.outputs:
            if graph.slots[s].kind is not SlotKind.TEMP:
                kind = graph.slots[s].kind.value
                raise FormatError(f"{where} writes slot {s}, which is a {kind} slot")
            if s in written:
                raise FormatError(f"{where} writes slot {s}, which is already written")
            written.add(s)
    for s in graph.outputs:
        if s not in written:
            raise FormatError(f"graph output {s} is never written")


def _constant_nbytes(graph: Graph, slot: int) -> int:
    t = graph.slots[slot].type
    if any(isinstance(d, SymDim) for d in t.shape):
        raise FormatError(f"constant slot {slot} ({graph.slots[slot].name!r}) has a dynamic shape")
    return ITEMSIZE[t.dtype] * math.prod(t.shape)


def check_constants(graph: Graph, constants: Mapping[int, Constant], data_size: int) -> None:
    """Every constant slot has bytes of the size its type needs, inside the data segment."""
    expected = set(graph.constants())
    missing = sorted(expected - constants.keys())
    if missing:
        raise FormatError(f"constant slot {missing[0]} ({graph.slots[missing[0]].name!r}) has no bytes")
    for slot, c in constants.items():
        if slot not in expected or c.slot != slot:
            raise FormatError(f"slot {slot} has bytes but is not a constant slot")
        if c.offset % ALIGNMENT or c.offset + c.nbytes > data_size:
            raise FormatError(
                f"constant slot {slot}: bytes [{c.offset}, {c.offset + c.nbytes}) are not an aligned "
                f"range of the {data_size}-byte weight segment"
            )
        need = _constant_nbytes(graph, slot)
        if c.nbytes != need:
            t = graph.slots[slot].type
            raise FormatError(
                f"constant slot {slot} holds {c.nbytes} bytes, {t.dtype}{list(t.shape)} needs {need}"
            )


# The two directions, importable from here (they build on the format above).
from .payload_read import decode_payload  # noqa: E402,F401
from .payload_write import encode_external_payload, encode_payload, place_constants  # noqa: E402,F401
