"""Find the MLX delegate's payload inside an ExecuTorch .pte file, without ExecuTorch.

mlx-pte's delegate id is ``MLXPteBackend``; files written before it was named apart from
upstream ExecuTorch's backend carry ``MLXBackend``, which is also upstream's id. A
program has exactly one delegate with either id.

A .pte is a FlatBuffer (schema ``executorch_flatbuffer.Program``, file identifier
"ET12"). When the program has segments, an extended header follows the identifier
(bytes 8..): magic "eh00", u32 header length, u64 program size, u64 segment base
offset and, in headers of 32 bytes or more, u64 segment data size; segment offsets are
relative to the segment base. A delegate's processed bytes are either inline
(``Program.backend_delegate_data[index].data``) or a segment
(``Program.segments[index]``), as its ``BackendDelegateDataReference`` says.

Upstream's MLX programs also need two things outside the delegate: the named data map
(``Program.named_data``: key -> segment, where their weights live) and the constant
methods that publish the cache geometry (execution plans without inputs or delegates
whose one output is an Int, or an int tensor stored in the constant segment or the
inline ``constant_buffer``).
"""
from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Union

import numpy as np

from mlx_pte.schemas.flatread import FlatBuffer, FlatBufferError, Table

from .errors import FormatError
from .payload import Payload, decode_payload
from .upstream.importer import UPSTREAM_MAGIC, ImportedPayload, import_program


BACKEND_ID = "MLXPteBackend"
LEGACY_BACKEND_ID = "MLXBackend"  # mlx-pte's files before the rename, and upstream's
DELEGATE_IDS = (BACKEND_ID, LEGACY_BACKEND_ID)
PROGRAM_IDENTIFIER = b"ET12"
_EXTENDED_MAGIC = b"eh00"
_EXTENDED = struct.Struct("<4sIQQ")  # magic, length, program size, segment base offset
_U64 = struct.Struct("<Q")

# Field indices (declaration order) in ExecuTorch's schema/program.fbs.
_PROGRAM_EXECUTION_PLAN, _PROGRAM_CONSTANT_BUFFER, _PROGRAM_DELEGATE_DATA, _PROGRAM_SEGMENTS = 1, 2, 3, 4
_PROGRAM_CONSTANT_SEGMENT, _PROGRAM_NAMED_DATA = 5, 7
_PLAN_NAME, _PLAN_VALUES, _PLAN_INPUTS, _PLAN_OUTPUTS, _PLAN_DELEGATES = 0, 2, 3, 4, 7
_EVALUE_TYPE, _EVALUE_VALUE = 0, 1
_KERNEL_INT, _KERNEL_TENSOR = 2, 5  # KernelTypes union members
_INT_VALUE = 0
_TENSOR_SCALAR_TYPE, _TENSOR_SIZES, _TENSOR_DATA_BUFFER = 0, 2, 5
_BUFFER_STORAGE = 0
_SUBSEGMENT_INDEX, _SUBSEGMENT_OFFSETS = 0, 1
_NAMED_KEY, _NAMED_SEGMENT = 0, 1
# ExecuTorch ScalarType codes of the int tensors a constant method may return.
_INT_TENSORS = {3: struct.Struct("<i"), 4: struct.Struct("<q")}
_DELEGATE_ID, _DELEGATE_PROCESSED = 0, 1
_REFERENCE_LOCATION, _REFERENCE_INDEX = 0, 1
_INLINE_DATA = 0
_SEGMENT_OFFSET, _SEGMENT_SIZE = 0, 1
_INLINE, _SEGMENT = 0, 1  # DataLocation


@dataclass(frozen=True)
class _Layout:
    """Where the program FlatBuffer and the segments are in the file."""

    program_size: int
    segment_base: int  # 0 = no segments


ConstantValue = Union[int, tuple[int, ...]]


@dataclass(frozen=True)
class ProgramContents:
    """What mlx-pte reads of an ExecuTorch program; every view is into the file (no copy)."""

    payload: memoryview  # the MLX delegate's processed bytes
    named_data: Mapping[str, memoryview]
    constant_methods: Mapping[str, ConstantValue]


def read_program(pte: Union[bytes, memoryview]) -> ProgramContents:
    """The MLX delegate's payload, the named data and the constant methods' values.

    Raises:
        FormatError: not an ExecuTorch program, truncated, malformed, or not exactly one
            delegate with an id of ``DELEGATE_IDS``.
    """
    view = memoryview(pte).cast("B")
    layout = _layout(view)
    try:
        program = FlatBuffer(view[: layout.program_size]).root("Program")
        return ProgramContents(
            _find_payload(program, view, layout),
            _named_data(program, view, layout),
            _constant_methods(program, view, layout),
        )
    except FlatBufferError as exc:
        raise FormatError(f"the ExecuTorch program is malformed: {exc}") from None


def delegate_payload(pte: Union[bytes, memoryview]) -> memoryview:
    """The processed bytes of the program's single MLX delegate (no copy); see read_program."""
    return read_program(pte).payload


def read_pte(path: Union[str, os.PathLike]) -> Union[Payload, ImportedPayload]:
    """Map a .pte file and decode its MLX delegate's payload, mlx-pte's own or upstream
    ExecuTorch's (imported into the same IR); the weights stay in the mapping.

    Raises:
        FormatError (or a subclass): the message starts with the file's path.
        OSError: the file cannot be opened.
    """
    # Non-blocking, so a FIFO is refused at once instead of waiting for a writer.
    with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise FormatError(f"{os.fspath(path)}: not a regular file (a pipe, device or socket); pass a .pte file")
        if info.st_size == 0:
            raise FormatError(f"{os.fspath(path)}: the file is empty")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        program = decode_program(mapped)
    except FormatError as exc:
        raise type(exc)(f"{os.fspath(path)}: {exc}") from None
    return replace(program, release=_PageReleaser(mapped)) if isinstance(program, Payload) else program


class _PageReleaser:
    """Drops the pages of a view of one mapping from the process (``MADV_DONTNEED``: they
    stay in the page cache), so copying every weight out of a mapped file does not leave
    the file resident beside the copies."""

    def __init__(self, mapped: mmap.mmap) -> None:
        self._mapped = mapped
        self._base = np.frombuffer(mapped, np.uint8).ctypes.data if len(mapped) else 0

    def __call__(self, view: memoryview) -> None:
        if not len(view) or not hasattr(self._mapped, "madvise"):
            return
        start = np.frombuffer(view, np.uint8).ctypes.data - self._base
        begin = start - start % mmap.PAGESIZE
        self._mapped.madvise(mmap.MADV_DONTNEED, begin, start + len(view) - begin)


def decode_program(pte: Union[bytes, memoryview]) -> Union[Payload, ImportedPayload]:
    """The program in a .pte's bytes: mlx-pte's payload decoded, or upstream's imported.

    Raises:
        FormatError (or a subclass): anything is wrong; nothing else.
    """
    contents = read_program(pte)
    if bytes(contents.payload[4:8]) == UPSTREAM_MAGIC:
        return import_program(contents.payload, contents.named_data, contents.constant_methods)
    return decode_payload(contents.payload, contents.named_data)


def _layout(view: memoryview) -> _Layout:
    if len(view) < 8 or bytes(view[4:6]) != PROGRAM_IDENTIFIER[:2]:
        raise FormatError("not an ExecuTorch program (no ET file identifier at byte 4)")
    if bytes(view[4:8]) != PROGRAM_IDENTIFIER:
        raise FormatError(
            f"ExecuTorch program format {bytes(view[4:8]).decode('ascii', 'replace')!r} is not "
            f"supported (this mlx-pte reads {PROGRAM_IDENTIFIER.decode()})"
        )
    if bytes(view[8:12]) != _EXTENDED_MAGIC:
        return _Layout(len(view), 0)
    if len(view) < 8 + _EXTENDED.size:
        raise FormatError(f"the file is truncated inside its extended header ({len(view)} bytes)")
    _, length, program_size, segment_base = _EXTENDED.unpack_from(view, 8)
    if length < _EXTENDED.size or 8 + length > len(view):
        raise FormatError(f"the extended header's length {length} is invalid")
    segment_size = _U64.unpack_from(view, 8 + _EXTENDED.size)[0] if length >= _EXTENDED.size + 8 else 0
    if not 8 + length <= program_size <= len(view):
        raise FormatError(
            f"the file is truncated: the program needs {program_size} bytes, the file has {len(view)}"
        )
    if segment_base and (segment_base < program_size or segment_base + segment_size > len(view)):
        raise FormatError(
            f"the file is truncated or corrupt: its segments span bytes [{segment_base}, "
            f"{segment_base + segment_size}), the file has {len(view)}"
        )
    return _Layout(program_size, segment_base)


def _find_payload(program: Table, view: memoryview, layout: _Layout) -> memoryview:
    references = [
        delegate.table(_DELEGATE_PROCESSED, "processed")
        for plan in program.tables(_PROGRAM_EXECUTION_PLAN, "execution_plan")
        for delegate in plan.tables(_PLAN_DELEGATES, "delegates")
        if delegate.string(_DELEGATE_ID, "id") in DELEGATE_IDS
    ]
    if len(references) != 1:
        raise FormatError(
            f"the program has {len(references)} MLX delegates ({' or '.join(DELEGATE_IDS)}), "
            "mlx-pte needs exactly one (was this file exported for MLX?)"
        )
    reference: Optional[Table] = references[0]
    if reference is None:
        raise FormatError("the MLX delegate has no data reference")
    location = reference.scalar(_REFERENCE_LOCATION, "b", _INLINE, "location")
    index = reference.scalar(_REFERENCE_INDEX, "I", 0, "index")
    if location == _INLINE:
        blobs = program.tables(_PROGRAM_DELEGATE_DATA, "backend_delegate_data")
        if index >= len(blobs):
            raise FormatError(
                f"the MLX delegate refers to inline data {index}, which does not exist"
            )
        data = blobs[index].bytes(_INLINE_DATA, "data")
        if data is None:
            raise FormatError("the MLX delegate's inline data is empty")
        return data
    if location != _SEGMENT:
        raise FormatError(f"the MLX delegate has unknown data location {location}")
    return _segment(view, layout, program.tables(_PROGRAM_SEGMENTS, "segments"), index, "the MLX delegate")


def _segment(view: memoryview, layout: _Layout, segments: list[Table], index: int, what: str) -> memoryview:
    """Bytes of segment ``index``, bounds-checked."""
    if index >= len(segments) or not layout.segment_base:
        raise FormatError(f"{what} refers to segment {index}, which does not exist")
    start = layout.segment_base + segments[index].scalar(_SEGMENT_OFFSET, "Q", 0, "offset")
    end = start + segments[index].scalar(_SEGMENT_SIZE, "Q", 0, "size")
    if end > len(view):
        raise FormatError(f"the file is truncated: {what}'s segment ends at byte {end}, the file has {len(view)}")
    return view[start:end]


def _named_data(program: Table, view: memoryview, layout: _Layout) -> dict[str, memoryview]:
    segments = program.tables(_PROGRAM_SEGMENTS, "segments")
    named: dict[str, memoryview] = {}
    for entry in program.tables(_PROGRAM_NAMED_DATA, "named_data"):
        key = entry.string(_NAMED_KEY, "key")
        if key is None or key in named:
            raise FormatError(f"{entry.name} has {'no key' if key is None else f'the duplicate key {key!r}'}")
        index = entry.scalar(_NAMED_SEGMENT, "I", 0, "segment_index")
        named[key] = _segment(view, layout, segments, index, f"named data {key!r}")
    return named


def _constant_methods(program: Table, view: memoryview, layout: _Layout) -> dict[str, ConstantValue]:
    methods: dict[str, ConstantValue] = {}
    for plan in program.tables(_PROGRAM_EXECUTION_PLAN, "execution_plan"):
        outputs = plan.scalars(_PLAN_OUTPUTS, "i", "outputs")
        if plan.tables(_PLAN_DELEGATES, "delegates") or plan.scalars(_PLAN_INPUTS, "i", "inputs") or len(outputs) != 1:
            continue
        values = plan.tables(_PLAN_VALUES, "values")
        name = plan.string(_PLAN_NAME, "name") or ""
        if not 0 <= outputs[0] < len(values):
            raise FormatError(f"method {name!r} returns value {outputs[0]}, which does not exist")
        value = _constant_value(program, view, layout, values[outputs[0]], name)
        if value is not None:
            methods[name] = value
    return methods


def _constant_value(
    program: Table, view: memoryview, layout: _Layout, evalue: Table, method: str
) -> Optional[ConstantValue]:
    """An Int's value, or an int tensor's elements; None for any other kind of value."""
    kind = evalue.scalar(_EVALUE_TYPE, "B", 0, "val_type")
    value = evalue.table(_EVALUE_VALUE, "val")
    if value is None or kind not in (_KERNEL_INT, _KERNEL_TENSOR):
        return None
    if kind == _KERNEL_INT:
        return value.scalar(_INT_VALUE, "q", 0, "int_val")
    element = _INT_TENSORS.get(value.scalar(_TENSOR_SCALAR_TYPE, "b", 0, "scalar_type"))
    if element is None:
        return None
    count = 1
    for size in value.scalars(_TENSOR_SIZES, "i", "sizes"):
        count *= size
    raw = _constant_buffer(program, view, layout, value.scalar(_TENSOR_DATA_BUFFER, "I", 0, "data_buffer_idx"), method)
    if count < 0 or len(raw) < count * element.size:
        raise FormatError(f"method {method!r}: its constant tensor needs {count * element.size} bytes, has {len(raw)}")
    return tuple(element.unpack_from(raw, i * element.size)[0] for i in range(count))


def _constant_buffer(program: Table, view: memoryview, layout: _Layout, index: int, method: str) -> memoryview:
    """Constant data ``index``: in the constant segment when the program has one, else inline."""
    what = f"method {method!r}'s constant"
    subsegment = program.table(_PROGRAM_CONSTANT_SEGMENT, "constant_segment")
    offsets = () if subsegment is None else subsegment.scalars(_SUBSEGMENT_OFFSETS, "Q", "offsets")
    if offsets:
        segments = program.tables(_PROGRAM_SEGMENTS, "segments")
        data = _segment(view, layout, segments, subsegment.scalar(_SUBSEGMENT_INDEX, "I", 0, "segment_index"), what)
        if index >= len(offsets) or offsets[index] > len(data):
            raise FormatError(f"{what} refers to constant data {index}, which does not exist")
        return data[offsets[index] :]
    buffers = program.tables(_PROGRAM_CONSTANT_BUFFER, "constant_buffer")
    if index >= len(buffers):
        raise FormatError(f"{what} refers to constant buffer {index}, which does not exist")
    return buffers[index].bytes(_BUFFER_STORAGE, "storage") or memoryview(b"")
