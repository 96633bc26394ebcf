"""Reading the delegate payload (``ir.payload`` gives the format): header and checksum,
the FlatBuffer graph, the manifest, and the weights as views (never copied).
"""
from __future__ import annotations

import json
import zlib
from typing import Mapping, Optional, Union

from mlx_pte.schemas.flatread import FlatBuffer, FlatBufferError, Table

from .errors import FormatError
from .graph import AttrValue, Constant, Dim, Graph, Instruction, ScalarType, Slot, SlotRef, SymDim, TensorType
from .payload import (
    ALIGNMENT, ATTR_KIND, CRC_START, DTYPE_NAME, FORMAT_VERSION, HEADER, INLINE_VERSION, MAGIC, PREFIX, SLOT_KIND,
    VALUE_TYPE, WEIGHTS_KEY, Payload, check_constants, check_graph,
)  # fmt: skip


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
    check_constants(graph, constants, len(data))
    return Payload(graph, manifest, constants, data)


def _sections(view: memoryview, named_data: Mapping[str, memoryview]) -> tuple[memoryview, memoryview, memoryview]:
    """Check the header and checksum; return the graph, manifest and data views."""
    if len(view) < PREFIX.size:
        raise FormatError(f"the payload is {len(view)} bytes, too short to be an mlx-pte payload")
    magic, version = PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise FormatError(f"not an mlx-pte payload: it starts with {bytes(magic)!r}, expected {MAGIC!r}")
    if version > FORMAT_VERSION:
        raise FormatError(
            f"payload format version {version} is newer than this mlx-pte reads "
            f"(up to {FORMAT_VERSION}): upgrade mlx-pte"
        )
    if version < 1:
        raise FormatError(f"payload format version {version} is invalid")
    if len(view) < HEADER.size:
        raise FormatError(
            f"the payload is truncated: {len(view)} bytes, less than its {HEADER.size}-byte header"
        )
    _, _, g_at, g_size, m_at, m_size, d_at, d_size, crc, reserved = HEADER.unpack_from(view)
    g_end, m_end, d_end = g_at + g_size, m_at + m_size, d_at + d_size
    inline = version == INLINE_VERSION
    if not (HEADER.size <= g_at <= g_end <= m_at <= m_end) or (inline and (m_end > d_at or d_at % ALIGNMENT)):
        raise FormatError("the payload's header is corrupt (its sections overlap or are misplaced)")
    if reserved or (not inline and d_at):
        raise FormatError("the payload's header is corrupt (its sections overlap or are misplaced)")
    end = d_end if inline else m_end
    if end > len(view):
        raise FormatError(f"the payload is truncated: it needs {end} bytes, has {len(view)}")
    actual = zlib.crc32(view[m_at:m_end], zlib.crc32(view[g_at:g_end], zlib.crc32(view[:CRC_START])))
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
    kind = _code(SLOT_KIND, t.scalar(1, "b", 0, "kind"), f"{t.name}.kind")
    value_type = _code(VALUE_TYPE, t.scalar(2, "b", 0, "type"), f"{t.name}.type")
    if value_type != "tensor":
        return Slot(name, kind, ScalarType(value_type))
    dtype = _code(DTYPE_NAME, t.scalar(3, "b", 0, "dtype"), f"{t.name}.dtype")
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
    if kind == ATTR_KIND.none:
        return name, None
    if kind == ATTR_KIND.bool and int_value in (0, 1):
        return name, bool(int_value)
    if kind == ATTR_KIND.int:
        return name, int_value
    if kind == ATTR_KIND.float:
        return name, t.scalar(3, "d", 0.0, "float_value")
    if kind == ATTR_KIND.str:
        text = t.string(4, "str_value")
        if text is not None:
            return name, text
    if kind == ATTR_KIND.ref:
        return name, SlotRef(int_value)
    if kind == ATTR_KIND.list:
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
            if kind == ATTR_KIND.int:
                items.append(next(ints))
            elif kind == ATTR_KIND.ref:
                items.append(SlotRef(next(ints)))
            elif kind == ATTR_KIND.float:
                items.append(next(floats))
            else:
                raise FormatError(f"{t.name}: list item kind {kind} is not int, float or ref")
    except StopIteration:
        raise FormatError(f"{t.name}: the list has more items than values") from None
    if next(ints, None) is not None or next(floats, None) is not None:
        raise FormatError(f"{t.name}: the list has more values than items")
    return tuple(items)
