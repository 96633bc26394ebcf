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
"""
from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Union

import flatbuffers
import numpy as np

from mlx_pte.schemas import mlx_graph_generated as fb
from mlx_pte.schemas.flatread import FlatBuffer, FlatBufferError, Table

from .catalog import validate_graph
from .errors import FormatError
from .quantization import quantized_constants
from .graph import (
    DTYPES,
    AttrValue,
    Constant,
    Dim,
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

_PREFIX = struct.Struct("<4sI")  # magic, version: all a reader may assume of any version
_HEADER = struct.Struct("<4sI6QII")
_CRC_START = _HEADER.size - 8  # the CRC field; the header bytes before it are summed

ITEMSIZE = {
    "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "uint32": 4,
}  # fmt: skip

ConstantBytes = Union[bytes, bytearray, memoryview, np.ndarray]

# IR names <-> schema enum codes. The schema's enum members are named like the IR
# values, so each table is derived rather than listed twice.
_DTYPE_CODE = {name: getattr(fb.DType, name) for name in DTYPES}
_SLOT_KIND_CODE = {kind: getattr(fb.SlotKind, kind.value) for kind in SlotKind}
_VALUE_TYPE_CODE = {name: getattr(fb.ValueType, name) for name in ("tensor", "int", "float", "bool")}
_DTYPE_NAME = {code: name for name, code in _DTYPE_CODE.items()}
_SLOT_KIND = {code: kind for kind, code in _SLOT_KIND_CODE.items()}
_VALUE_TYPE = {code: name for name, code in _VALUE_TYPE_CODE.items()}
_A = fb.AttrKind


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
        if t.dtype not in _DTYPE_CODE:
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
        if t.kind not in _VALUE_TYPE_CODE or t.kind == "tensor":
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


def _check_constants(graph: Graph, constants: Mapping[int, Constant], data_size: int) -> None:
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


# -- encode ---------------------------------------------------------------------------


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
    _check_constants(graph, placed, cursor)
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
        graph_bytes = _build_graph(graph, placed.values())
    except (UnicodeEncodeError, struct.error, OverflowError) as exc:
        raise FormatError(f"cannot write the graph: {exc}") from None
    try:
        manifest_bytes = json.dumps(dict(manifest), ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise FormatError(f"the manifest cannot be written as JSON: {exc}") from None
    graph_at = _HEADER.size
    manifest_at = graph_at + len(graph_bytes)
    data_at = _align(manifest_at + len(manifest_bytes)) if version == INLINE_VERSION else 0
    fields = (MAGIC, version, graph_at, len(graph_bytes), manifest_at, len(manifest_bytes), data_at, data_size)
    crc = zlib.crc32(_HEADER.pack(*fields, 0, 0)[:_CRC_START])
    crc = zlib.crc32(manifest_bytes, zlib.crc32(graph_bytes, crc))
    return b"".join([_HEADER.pack(*fields, crc, 0), graph_bytes, manifest_bytes])


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


def _build_graph(graph: Graph, constants) -> bytes:
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
    fb.SlotAddKind(b, _SLOT_KIND_CODE[slot.kind])
    if shape is None:
        fb.SlotAddType(b, _VALUE_TYPE_CODE[slot.type.kind])
    else:
        fb.SlotAddType(b, _VALUE_TYPE_CODE["tensor"])
        fb.SlotAddDtype(b, _DTYPE_CODE[slot.type.dtype])
        fb.SlotAddShape(b, shape)
    return fb.SlotEnd(b)


def _build_attr(b: flatbuffers.Builder, name: str, value: AttrValue) -> int:
    name_at = b.CreateString(name)
    int_value, float_value, str_at, list_vectors = 0, 0.0, None, None
    if value is None:
        kind = _A.none
    elif isinstance(value, bool):
        kind, int_value = _A.bool, int(value)
    elif isinstance(value, int):
        kind, int_value = _A.int, value
    elif isinstance(value, float):
        kind, float_value = _A.float, value
    elif isinstance(value, str):
        kind, str_at = _A.str, b.CreateString(value)
    elif isinstance(value, SlotRef):
        kind, int_value = _A.ref, value.slot
    elif isinstance(value, tuple):
        kind, list_vectors = _A.list, _build_list(b, name, value)
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
            kinds.append(_A.ref)
            ints.append(item.slot)
        elif isinstance(item, int) and not isinstance(item, bool):
            kinds.append(_A.int)
            ints.append(item)
        elif isinstance(item, float):
            kinds.append(_A.float)
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


# -- decode ---------------------------------------------------------------------------


def decode_payload(
    blob: Union[bytes, memoryview], named_data: Optional[Mapping[str, memoryview]] = None
) -> Payload:
    """Parse and validate a payload without copying its weights.

    Args:
        blob: the payload.
        named_data: the program's named data (where a version 2 payload's weights are).

    Raises:
        FormatError: anything is wrong (bad magic, a newer format version, sections out
            of bounds, a checksum mismatch, a malformed graph or manifest, constants
            that do not fit); UnknownOpError (a FormatError) for an op this mlx-pte
            does not know.
    """
    view = memoryview(blob).cast("B")
    graph_view, manifest_view, data = _sections(view, named_data or {})
    try:
        graph, constant_list = _read_graph(FlatBuffer(graph_view).root("Graph"))
    except FlatBufferError as exc:
        raise FormatError(f"the payload's graph is malformed: {exc}") from None
    manifest = _read_manifest(manifest_view)
    check_graph(graph)
    constants = {c.slot: c for c in constant_list}
    if len(constants) != len(constant_list):
        raise FormatError("a constant slot has bytes listed twice")
    _check_constants(graph, constants, len(data))
    return Payload(graph, manifest, constants, data)


def _sections(view: memoryview, named_data: Mapping[str, memoryview]) -> tuple[memoryview, memoryview, memoryview]:
    """Check the header and checksum; return the graph, manifest and data views."""
    if len(view) < _PREFIX.size:
        raise FormatError(f"the payload is {len(view)} bytes, too short to be an mlx-pte payload")
    magic, version = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise FormatError(f"not an mlx-pte payload: it starts with {bytes(magic)!r}, expected {MAGIC!r}")
    if version > FORMAT_VERSION:
        raise FormatError(
            f"payload format version {version} is newer than this mlx-pte reads "
            f"(up to {FORMAT_VERSION}): upgrade mlx-pte"
        )
    if version < 1:
        raise FormatError(f"payload format version {version} is invalid")
    if len(view) < _HEADER.size:
        raise FormatError(
            f"the payload is truncated: {len(view)} bytes, less than its {_HEADER.size}-byte header"
        )
    _, _, g_at, g_size, m_at, m_size, d_at, d_size, crc, reserved = _HEADER.unpack_from(view)
    g_end, m_end, d_end = g_at + g_size, m_at + m_size, d_at + d_size
    inline = version == INLINE_VERSION
    if not (_HEADER.size <= g_at <= g_end <= m_at <= m_end) or (inline and (m_end > d_at or d_at % ALIGNMENT)):
        raise FormatError("the payload's header is corrupt (its sections overlap or are misplaced)")
    if reserved or (not inline and d_at):
        raise FormatError("the payload's header is corrupt (its sections overlap or are misplaced)")
    end = d_end if inline else m_end
    if end > len(view):
        raise FormatError(f"the payload is truncated: it needs {end} bytes, has {len(view)}")
    actual = zlib.crc32(view[m_at:m_end], zlib.crc32(view[g_at:g_end], zlib.crc32(view[:_CRC_START])))
    if actual != crc:
        raise FormatError("the payload is corrupt: its graph or manifest does not match the checksum")
    if inline:
        return view[g_at:g_end], view[m_at:m_end], view[d_at:d_end]
    weights = named_data.get(WEIGHTS_KEY)
    if weights is None or len(weights) < d_size:
        have = "none" if weights is None else f"{len(weights)} bytes"
        raise FormatError(
            f"the program's weights (named data {WEIGHTS_KEY!r}, {d_size} bytes) are missing or truncated "
            f"(found {have}); export the model again"
        )
    return view[g_at:g_end], view[m_at:m_end], memoryview(weights).cast("B")[:d_size]


def _read_manifest(raw: memoryview) -> dict:
    try:
        manifest = json.loads(str(raw, "utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"the payload's manifest is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise FormatError("the payload's manifest is not a JSON object")
    return manifest


def _code(table: dict, code: int, what: str):
    try:
        return table[code]
    except KeyError:
        raise FormatError(f"{what} has unknown code {code} (written by a newer mlx-pte?)") from None


def _read_graph(root: Table) -> tuple[Graph, list[Constant]]:
    graph = Graph(
        slots=[_read_slot(t) for t in root.tables(0, "slots")],
        instructions=[_read_instruction(t) for t in root.tables(1, "instructions")],
        inputs=list(root.scalars(2, "I", "inputs")),
        outputs=list(root.scalars(3, "I", "outputs")),
    )
    constants = [
        Constant(
            t.scalar(0, "I", 0, "slot"), t.scalar(1, "Q", 0, "offset"), t.scalar(2, "Q", 0, "nbytes")
        )
        for t in root.tables(4, "constants")
    ]
    return graph, constants


def _read_dim(t: Table) -> Dim:
    symbol = t.string(1, "symbol")
    if symbol is None:
        return t.scalar(0, "q", -1, "size")  # a negative size is rejected by check_graph
    high = t.scalar(3, "q", -1, "max")
    return SymDim(symbol, t.scalar(2, "q", 0, "min"), None if high == -1 else high)


def _read_slot(t: Table) -> Slot:
    name = t.string(0, "name") or ""
    kind = _code(_SLOT_KIND, t.scalar(1, "b", 0, "kind"), f"{t.name}.kind")
    value_type = _code(_VALUE_TYPE, t.scalar(2, "b", 0, "type"), f"{t.name}.type")
    if value_type != "tensor":
        return Slot(name, kind, ScalarType(value_type))
    dtype = _code(_DTYPE_NAME, t.scalar(3, "b", 0, "dtype"), f"{t.name}.dtype")
    return Slot(name, kind, TensorType(dtype, tuple(_read_dim(d) for d in t.tables(4, "shape"))))


def _read_instruction(t: Table) -> Instruction:
    op = t.string(0, "op")
    if op is None:
        raise FormatError(f"{t.name} has no op name")
    return Instruction(
        op=op,
        inputs=tuple(None if s == -1 else s for s in t.scalars(1, "i", "inputs")),
        outputs=t.scalars(2, "I", "outputs"),
        attrs=tuple(_read_attr(a) for a in t.tables(3, "attrs")),
    )


def _read_attr(t: Table) -> tuple[str, AttrValue]:
    name = t.string(0, "name")
    if name is None:
        raise FormatError(f"{t.name} has no name")
    kind = t.scalar(1, "b", 0, "kind")
    int_value = t.scalar(2, "q", 0, "int_value")
    if kind == _A.none:
        return name, None
    if kind == _A.bool and int_value in (0, 1):
        return name, bool(int_value)
    if kind == _A.int:
        return name, int_value
    if kind == _A.float:
        return name, t.scalar(3, "d", 0.0, "float_value")
    if kind == _A.str:
        text = t.string(4, "str_value")
        if text is not None:
            return name, text
    if kind == _A.ref:
        return name, SlotRef(int_value)
    if kind == _A.list:
        return name, _read_list(t)
    raise FormatError(
        f"attribute {name!r} has an unknown or malformed kind {kind} (written by a newer mlx-pte?)"
    )


def _read_list(t: Table) -> tuple:
    ints = iter(t.scalars(6, "q", "ints"))
    floats = iter(t.scalars(7, "d", "floats"))
    items: list = []
    try:
        for kind in t.scalars(5, "b", "item_kinds"):
            if kind == _A.int:
                items.append(next(ints))
            elif kind == _A.ref:
                items.append(SlotRef(next(ints)))
            elif kind == _A.float:
                items.append(next(floats))
            else:
                raise FormatError(f"{t.name}: list item kind {kind} is not int, float or ref")
    except StopIteration:
        raise FormatError(f"{t.name}: the list has more items than values") from None
    if next(ints, None) is not None or next(floats, None) is not None:
        raise FormatError(f"{t.name}: the list has more values than items")
    return tuple(items)
