"""A bounded reader for FlatBuffer tables, for data that may be truncated or corrupt.

The ``flatbuffers`` Python runtime has no verifier and trusts every offset it reads, so
malformed input surfaces as IndexError, struct.error, garbage, or effectively endless
loops. This reader checks each access instead:

- every table, vtable, field, vector and string lies inside the buffer, and a field lies
  inside its table;
- strings are valid UTF-8;
- the objects visited are charged to a budget of the buffer's size, so offsets shared
  or pointing back at each other cannot make a small buffer cost unbounded work.

Anything wrong raises ``FlatBufferError`` naming the field. Field indices are the
0-based declaration order in the schema (the vtable slot), as flatc numbers them.
"""
from __future__ import annotations

import struct
from functools import lru_cache
from typing import Any, Optional, Union

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")


class FlatBufferError(ValueError):
    """Malformed FlatBuffer data; the message names the field that could not be read."""


@lru_cache(maxsize=None)
def _scalar(code: str) -> struct.Struct:
    return struct.Struct("<" + code)


class FlatBuffer:
    """A buffer plus the work budget shared by every table read from it."""

    def __init__(self, buf: Union[bytes, memoryview]):
        self.buf = memoryview(buf).cast("B")
        self._budget = len(self.buf) + 1

    def root(self, name: str) -> "Table":
        """The root table; ``name`` labels it in error messages."""
        return Table(self, self.deref(0, name), name)

    def read(self, st: struct.Struct, pos: int, what: str) -> Any:
        if pos < 0 or pos + st.size > len(self.buf):
            raise FlatBufferError(f"{what}: byte {pos} lies outside the buffer ({len(self.buf)} bytes)")
        return st.unpack_from(self.buf, pos)[0]

    def deref(self, pos: int, what: str) -> int:
        """Follow the unsigned offset stored at ``pos``."""
        return pos + self.read(_U32, pos, what)

    def charge(self, units: int, what: str) -> None:
        self._budget -= units
        if self._budget < 0:
            raise FlatBufferError(f"{what}: the data refers to more objects than the buffer can hold")

    def vector(self, pos: int, elem_size: int, what: str) -> tuple[int, int]:
        """Bounds-check the vector whose offset is stored at ``pos``.

        Returns:
            (position of the first element, element count).
        """
        start = self.deref(pos, what)
        length = self.read(_U32, start, what)
        if start + 4 + length * elem_size > len(self.buf):
            raise FlatBufferError(f"{what}: a vector of {length} items runs past the end of the buffer")
        self.charge(length, what)
        return start + 4, length


class Table:
    """One table: checked field access by vtable index."""

    __slots__ = ("_fb", "_pos", "_vtable", "_vsize", "_osize", "name")

    def __init__(self, fb: FlatBuffer, pos: int, name: str):
        fb.charge(1, name)
        self._fb, self._pos, self.name = fb, pos, name
        self._vtable = pos - fb.read(_I32, pos, name)
        self._vsize = fb.read(_U16, self._vtable, f"{name} (vtable)")
        self._osize = fb.read(_U16, self._vtable + 2, f"{name} (vtable)")
        if self._vsize < 4 or self._vsize % 2 or self._vtable + self._vsize > len(fb.buf):
            raise FlatBufferError(f"{name}: malformed vtable")
        if self._osize < 4 or pos + self._osize > len(fb.buf):
            raise FlatBufferError(f"{name}: the table runs past the end of the buffer")

    def _field(self, index: int, size: int, what: str) -> Optional[int]:
        """Absolute position of field ``index`` (``size`` bytes inline), or None if absent."""
        entry = 4 + 2 * index
        if entry + 2 > self._vsize:
            return None
        offset = self._fb.read(_U16, self._vtable + entry, what)
        if offset == 0:
            return None
        if offset + size > self._osize:
            raise FlatBufferError(f"{what}: the field lies outside its table")
        return self._pos + offset

    def _what(self, field: str) -> str:
        return f"{self.name}.{field}"

    def scalar(self, index: int, code: str, default: Any, field: str) -> Any:
        """A scalar field; ``code`` is its struct format character (e.g. "q", "d", "B")."""
        st = _scalar(code)
        pos = self._field(index, st.size, self._what(field))
        return default if pos is None else self._fb.read(st, pos, self._what(field))

    def string(self, index: int, field: str) -> Optional[str]:
        raw = self.bytes(index, field)
        if raw is None:
            return None
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise FlatBufferError(f"{self._what(field)}: the string is not valid UTF-8") from None

    def bytes(self, index: int, field: str) -> Optional[memoryview]:
        """A ``[ubyte]`` vector (or a string's bytes) as a view into the buffer."""
        what = self._what(field)
        pos = self._field(index, 4, what)
        if pos is None:
            return None
        start, length = self._fb.vector(pos, 1, what)
        return self._fb.buf[start : start + length]

    def scalars(self, index: int, code: str, field: str) -> tuple:
        """A vector of scalars; absent reads as empty."""
        what = self._what(field)
        pos = self._field(index, 4, what)
        if pos is None:
            return ()
        size = _scalar(code).size
        start, length = self._fb.vector(pos, size, what)
        return struct.unpack_from(f"<{length}{code}", self._fb.buf, start)

    def table(self, index: int, field: str) -> Optional["Table"]:
        what = self._what(field)
        pos = self._field(index, 4, what)
        return None if pos is None else Table(self._fb, self._fb.deref(pos, what), what)

    def tables(self, index: int, field: str) -> list["Table"]:
        """A vector of tables; absent reads as empty."""
        what = self._what(field)
        pos = self._field(index, 4, what)
        if pos is None:
            return []
        start, length = self._fb.vector(pos, 4, what)
        return [
            Table(self._fb, self._fb.deref(start + 4 * i, f"{what}[{i}]"), f"{what}[{i}]")
            for i in range(length)
        ]
