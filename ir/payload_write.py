"""Writing the delegate payload (``ir.payload`` gives the format): the graph as a FlatBuffer,
the manifest as JSON, and the weights inline (version 1) or placed in the program's named
data (version 2, streamed by the exporter).
"""
from __future__ import annotations

import json
import struct
import zlib
from typing import Mapping

import flatbuffers
import numpy as np

from mlx_pte.schemas import mlx_graph_generated as fb

from .errors import FormatError
from .graph import AttrValue, Constant, Dim, Graph, Instruction, Slot, SlotRef, SymDim, TensorType, UNTYPED_TENSOR
from .payload import (
    ALIGNMENT, ATTR_KIND, CRC_START, DTYPE_CODE, FORMAT_VERSION, HEADER, INLINE_VERSION, MAGIC, SLOT_KIND_CODE,
    VALUE_TYPE_CODE, WEIGHTS_KEY, ConstantBytes, check_constants, check_graph,
)  # fmt: skip


def encode_payload(
    graph: Graph, constants: Mapping[int, ConstantBytes], manifest: Mapping
) -> bytes:
    """Serialize a graph, its weights and its manifest into one payload (version 1:
    weights inline).

    Args:
        graph: a well-formed graph (``check_graph``); nothing is written otherwise.
        constants: the bytes of every constant slot (raw bytes, or an array whose
            C-order bytes are used as they are).
        manifest: a JSON-serializable mapping.

    Returns:
        The payload bytes.

    Raises:
        FormatError: the graph, a constant or the manifest cannot be written.
    """
    raw = {slot: _as_bytes(constants[slot]) for slot in sorted(constants)}
    placed, size = place_constants(graph, {slot: buf.nbytes for slot, buf in raw.items()})
    head = _encode_head(graph, placed, size, manifest, INLINE_VERSION)
    pieces: list = [head, bytes(_align(len(head)) - len(head))]
    end = 0
    for slot, buf in raw.items():
        pieces += [bytes(placed[slot].offset - end), buf]
        end = placed[slot].offset + buf.nbytes
    return b"".join(pieces)


def place_constants(graph: Graph, sizes: Mapping[int, int]) -> tuple[dict[int, Constant], int]:
    """Where each constant goes in the weight segment (slot order, each aligned), and the
    segment's size; checks the graph and that each size fits its slot's type.

    Raises:
        FormatError: a malformed graph, or a constant of the wrong size.
    """
    check_graph(graph)
    placed: dict[int, Constant] = {}
    cursor = 0
    for slot in sorted(sizes):
        offset = _align(cursor)
        placed[slot] = Constant(slot, offset, sizes[slot])
        cursor = offset + sizes[slot]
    check_constants(graph, placed, cursor)
    return placed, cursor


def encode_external_payload(graph: Graph, placed: Mapping[int, Constant], data_size: int, manifest: Mapping) -> bytes:
    """A version 2 payload: graph and manifest, the weights (placed by ``place_constants``)
    being the program's named data ``WEIGHTS_KEY`` of ``data_size`` bytes.

    Raises:
        FormatError: the graph or the manifest cannot be written.
    """
    return _encode_head(graph, placed, data_size, manifest, FORMAT_VERSION)


def _encode_head(graph: Graph, placed: Mapping[int, Constant], data_size: int, manifest: Mapping, version: int) -> bytes:
    """Header, graph and manifest; the inline data (version 1) starts at the next alignment."""
    try:
        graph_bytes = build_graph(graph, placed.values())
    except (UnicodeEncodeError, struct.error, OverflowError) as exc:
        raise FormatError(f"cannot write the graph: {exc}") from None
    try:
        manifest_bytes = json.dumps(dict(manifest), ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise FormatError(f"the manifest cannot be written as JSON: {exc}") from None
    graph_at = HEADER.size
    manifest_at = graph_at + len(graph_bytes)
    data_at = _align(manifest_at + len(manifest_bytes)) if version == INLINE_VERSION else 0
    fields = (MAGIC, version, graph_at, len(graph_bytes), manifest_at, len(manifest_bytes), data_at, data_size)
    crc = zlib.crc32(HEADER.pack(*fields, 0, 0)[:CRC_START])
    crc = zlib.crc32(manifest_bytes, zlib.crc32(graph_bytes, crc))
    return b"".join([HEADER.pack(*fields, crc, 0), graph_bytes, manifest_bytes])


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _as_bytes(value: ConstantBytes) -> memoryview:
    if hasattr(value, "data") and callable(value.data):  # a lazy source (export.tensor_source)
        value = value.data()
    if isinstance(value, np.ndarray):
        # A uint8 view works for every dtype, including extension ones such as bfloat16.
        return memoryview(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
    view = memoryview(value)
    return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())


def build_graph(graph: Graph, constants) -> bytes:
    """The graph's FlatBuffer, with ``constants`` (their slots, offsets and sizes), unchecked."""
    b = flatbuffers.Builder(1024)
    slots = [_build_slot(b, slot) for slot in graph.slots]
    instructions = [_build_instruction(b, instr) for instr in graph.instructions]
    consts = [_build_constant(b, c) for c in constants]
    slots_vec = _table_vector(b, fb.GraphStartSlotsVector, slots)
    instructions_vec = _table_vector(b, fb.GraphStartInstructionsVector, instructions)
    consts_vec = _table_vector(b, fb.GraphStartConstantsVector, consts)
    inputs_vec = b.CreateNumpyVector(np.asarray(graph.inputs, dtype=np.uint32))
    outputs_vec = b.CreateNumpyVector(np.asarray(graph.outputs, dtype=np.uint32))
    fb.GraphStart(b)
    fb.GraphAddSlots(b, slots_vec)
    fb.GraphAddInstructions(b, instructions_vec)
    fb.GraphAddInputs(b, inputs_vec)
    fb.GraphAddOutputs(b, outputs_vec)
    fb.GraphAddConstants(b, consts_vec)
    b.Finish(fb.GraphEnd(b))
    return bytes(b.Output())


def _table_vector(b: flatbuffers.Builder, start, offsets: list[int]) -> int:
    start(b, len(offsets))
    for offset in reversed(offsets):
        b.PrependUOffsetTRelative(offset)
    return b.EndVector()


def _build_dim(b: flatbuffers.Builder, dim: Dim) -> int:
    if isinstance(dim, SymDim):
        symbol = b.CreateString(dim.name)
        fb.DimStart(b)
        fb.DimAddSymbol(b, symbol)
        fb.DimAddMin(b, dim.min)
        fb.DimAddMax(b, -1 if dim.max is None else dim.max)
    else:
        fb.DimStart(b)
        fb.DimAddSize(b, dim)
    return fb.DimEnd(b)


def _build_slot(b: flatbuffers.Builder, slot: Slot) -> int:
    if slot.type == UNTYPED_TENSOR:
        raise FormatError(f"slot {slot.name!r} has no dtype and shape; mlx-pte's payload records every type")
    name = b.CreateString(slot.name)
    shape = None
    if isinstance(slot.type, TensorType):
        shape = _table_vector(b, fb.SlotStartShapeVector, [_build_dim(b, d) for d in slot.type.shape])
    fb.SlotStart(b)
    fb.SlotAddName(b, name)
    fb.SlotAddKind(b, SLOT_KIND_CODE[slot.kind])
    if shape is None:
        fb.SlotAddType(b, VALUE_TYPE_CODE[slot.type.kind])
    else:
        fb.SlotAddType(b, VALUE_TYPE_CODE["tensor"])
        fb.SlotAddDtype(b, DTYPE_CODE[slot.type.dtype])
        fb.SlotAddShape(b, shape)
    return fb.SlotEnd(b)


def _build_attr(b: flatbuffers.Builder, name: str, value: AttrValue) -> int:
    name_at = b.CreateString(name)
    int_value, float_value, str_at, list_vectors = 0, 0.0, None, None
    if value is None:
        kind = ATTR_KIND.none
    elif isinstance(value, bool):
        kind, int_value = ATTR_KIND.bool, int(value)
    elif isinstance(value, int):
        kind, int_value = ATTR_KIND.int, value
    elif isinstance(value, float):
        kind, float_value = ATTR_KIND.float, value
    elif isinstance(value, str):
        kind, str_at = ATTR_KIND.str, b.CreateString(value)
    elif isinstance(value, SlotRef):
        kind, int_value = ATTR_KIND.ref, value.slot
    elif isinstance(value, tuple):
        kind, list_vectors = ATTR_KIND.list, _build_list(b, name, value)
    else:
        raise FormatError(f"attribute {name!r}: cannot write a value of type {type(value).__name__}")
    fb.AttrStart(b)
    fb.AttrAddName(b, name_at)
    fb.AttrAddKind(b, kind)
    fb.AttrAddIntValue(b, int_value)
    fb.AttrAddFloatValue(b, float_value)
    if str_at is not None:
        fb.AttrAddStrValue(b, str_at)
    if list_vectors is not None:
        kinds_at, ints_at, floats_at = list_vectors
        fb.AttrAddItemKinds(b, kinds_at)
        fb.AttrAddInts(b, ints_at)
        fb.AttrAddFloats(b, floats_at)
    return fb.AttrEnd(b)


def _build_list(b: flatbuffers.Builder, name: str, items: tuple) -> tuple[int, int, int]:
    kinds, ints, floats = [], [], []
    for item in items:
        if isinstance(item, SlotRef):
            kinds.append(ATTR_KIND.ref)
            ints.append(item.slot)
        elif isinstance(item, int) and not isinstance(item, bool):
            kinds.append(ATTR_KIND.int)
            ints.append(item)
        elif isinstance(item, float):
            kinds.append(ATTR_KIND.float)
            floats.append(item)
        else:
            raise FormatError(f"attribute {name!r}: list item {item!r} is not an int, float or SlotRef")
    return (
        b.CreateNumpyVector(np.asarray(kinds, dtype=np.int8)),
        b.CreateNumpyVector(np.asarray(ints, dtype=np.int64)),
        b.CreateNumpyVector(np.asarray(floats, dtype=np.float64)),
    )


def _build_instruction(b: flatbuffers.Builder, instr: Instruction) -> int:
    op = b.CreateString(instr.op)
    operands = [-1 if s is None else s for s in instr.inputs]
    inputs = b.CreateNumpyVector(np.asarray(operands, dtype=np.int32))
    outputs = b.CreateNumpyVector(np.asarray(instr.outputs, dtype=np.uint32))
    attrs = [_build_attr(b, name, value) for name, value in instr.attrs]
    attrs_vec = _table_vector(b, fb.InstructionStartAttrsVector, attrs)
    fb.InstructionStart(b)
    fb.InstructionAddOp(b, op)
    fb.InstructionAddInputs(b, inputs)
    fb.InstructionAddOutputs(b, outputs)
    fb.InstructionAddAttrs(b, attrs_vec)
    return fb.InstructionEnd(b)


def _build_constant(b: flatbuffers.Builder, c: Constant) -> int:
    fb.ConstantStart(b)
    fb.ConstantAddSlot(b, c.slot)
    fb.ConstantAddOffset(b, c.offset)
    fb.ConstantAddNbytes(b, c.nbytes)
    return fb.ConstantEnd(b)
