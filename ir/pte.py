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
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Optional, Union

from mlx_pte.schemas.flatread import FlatBuffer, FlatBufferError, Table

from .errors import FormatError
from .payload import Payload, decode_payload

BACKEND_ID = "MLXPteBackend"
LEGACY_BACKEND_ID = "MLXBackend"  # mlx-pte's files before the rename, and upstream's
DELEGATE_IDS = (BACKEND_ID, LEGACY_BACKEND_ID)
PROGRAM_IDENTIFIER = b"ET12"
_EXTENDED_MAGIC = b"eh00"
_EXTENDED = struct.Struct("<4sIQQ")  # magic, length, program size, segment base offset
_U64 = struct.Struct("<Q")

# Field indices (declaration order) in ExecuTorch's schema/program.fbs.
_PROGRAM_EXECUTION_PLAN, _PROGRAM_DELEGATE_DATA, _PROGRAM_SEGMENTS = 1, 3, 4
_PLAN_DELEGATES = 7
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


def delegate_payload(pte: Union[bytes, memoryview]) -> memoryview:
    """The processed bytes of the program's single MLX delegate (no copy).

    Raises:
        FormatError: not an ExecuTorch program, truncated, malformed, or not exactly one
            delegate with an id of ``DELEGATE_IDS``.
    """
    view = memoryview(pte).cast("B")
    layout = _layout(view)
    try:
        program = FlatBuffer(view[: layout.program_size]).root("Program")
        return _find_payload(program, view, layout)
    except FlatBufferError as exc:
        raise FormatError(f"the ExecuTorch program is malformed: {exc}") from None


def read_pte(path: Union[str, os.PathLike]) -> Payload:
    """Map a .pte file and decode its MLX delegate's payload; the weights stay in the mapping.

    Raises:
        FormatError (or a subclass): the message starts with the file's path.
        OSError: the file cannot be opened.
    """
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise FormatError(f"{os.fspath(path)}: the file is empty")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return decode_payload(delegate_payload(mapped))
    except FormatError as exc:
        raise type(exc)(f"{os.fspath(path)}: {exc}") from None


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
    segments = program.tables(_PROGRAM_SEGMENTS, "segments")
    if index >= len(segments) or not layout.segment_base:
        raise FormatError(f"the MLX delegate refers to segment {index}, which does not exist")
    start = layout.segment_base + segments[index].scalar(_SEGMENT_OFFSET, "Q", 0, "offset")
    end = start + segments[index].scalar(_SEGMENT_SIZE, "Q", 0, "size")
    if end > len(view):
        raise FormatError(
            f"the file is truncated: the MLX segment ends at byte {end}, "
            f"the file has {len(view)}"
        )
    return view[start:end]
