"""Builds an IR graph from upstream's register-machine graph.

Upstream's instructions name tensor ids (Tids) and value ids (Vids) that are registers:
temps are recycled and an instruction may write its own operand. mlx-pte's IR writes each
slot once, so every write of an id gets a fresh slot and reads see the latest one.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from ..errors import FormatError
from ..graph import UNTYPED_TENSOR, AttrValue, Graph, Instruction, ScalarType, SlotKind, SlotRef

# ExecuTorch ScalarType codes (runtime/core/portable_type/scalar_type.h) -> IR dtypes.
SCALAR_TYPES = {
    0: "uint8", 1: "int8", 2: "int16", 3: "int32", 4: "int64",
    5: "float16", 6: "float32", 11: "bool", 15: "bfloat16", 28: "uint32",
}  # fmt: skip


class ImportBuilder:
    """The graph under construction and the current IR slot of every upstream id.

    Args:
        graph: the graph to extend (inputs and constants already added).
        n_tensors: how many Tids the upstream graph declares.
        n_values: how many Vids it declares.
        n_caches: how many caches its geometry publishes (``layer_id`` bound; None: unchecked,
            the caller's cache decides).
        writable_from: the first Tid instructions may write (constants and inputs come first).
        meta: the payload's recorded tensor types, by Tid (constants, inputs and outputs only).
    """

    def __init__(
        self, graph: Graph, n_tensors: int, n_values: int, n_caches: Optional[int], writable_from: int,
        meta: Sequence[Any] = (),
    ) -> None:  # fmt: skip
        self.graph = graph
        self._meta = meta
        self._n_tensors, self._n_values, self._n_caches = n_tensors, n_values, n_caches
        self._writable_from = writable_from
        self._tensors: dict[int, int] = {}
        self._values: dict[int, int] = {}
        self._transposed: dict[int, int] = {}  # slot -> the constant slot it is the 2-D transpose of
        self._rows: dict[int, tuple[int, int]] = {}  # slot -> (constant slot, indices slot) it is rows of
        self._constants: set[int] = set()

    @property
    def n_tensors(self) -> int:
        return self._n_tensors

    # -- ids -> slots ---------------------------------------------------------------
    def bind(self, tid: int, slot: int) -> None:
        """Tensor ``tid`` holds ``slot`` (a constant, an input, or an input's cast)."""
        self._tensors[tid] = slot
        if self.graph.slots[slot].kind is SlotKind.CONSTANT:
            self._constants.add(slot)

    def read(self, tid: Any) -> int:
        if tid is None:
            raise FormatError("a node is missing a required tensor operand")
        return self.slot_of(tid.idx)

    def slot_of(self, index: int) -> int:
        """The slot holding tensor ``index``'s current value."""
        slot = self._tensors.get(index)
        if slot is None:
            raise FormatError(f"the graph reads tensor {index} before anything writes it")
        return slot

    def read_optional(self, tid: Any) -> Optional[int]:
        return None if tid is None else self.read(tid)

    def write(self, tid: Any) -> int:
        if tid is None:
            raise FormatError("a node is missing its result tensor")
        if not self._writable_from <= tid.idx < self._n_tensors:
            raise FormatError(
                f"a node writes tensor {tid.idx}, which is a constant, an input or out of range "
                f"(instructions write tensors {self._writable_from}..{self._n_tensors - 1})"
            )
        slot = self.temp(f"t{tid.idx}")
        self._tensors[tid.idx] = slot
        return slot

    def alias(self, out: Any, x: Any) -> None:
        """``out`` now holds ``x``'s value (a copy of an immutable array is the array)."""
        self.assign(out, self.read(x))

    def assign(self, tid: Any, slot: int) -> None:
        """Tensor ``tid`` (one instructions may write) now holds ``slot``."""
        self.write(tid)
        self._tensors[tid.idx] = slot

    def value(self, vid: Any) -> SlotRef:
        if vid is None or vid.idx not in self._values:
            raise FormatError(f"a node reads value {None if vid is None else vid.idx} before anything writes it")
        return SlotRef(self._values[vid.idx])

    def write_value(self, vid: Any) -> int:
        if vid is None or not 0 <= vid.idx < self._n_values:
            raise FormatError(f"a node writes value {None if vid is None else vid.idx}, which is out of range")
        slot = self.graph.add_slot(f"v{vid.idx}", SlotKind.TEMP, ScalarType("int"))
        self._values[vid.idx] = slot
        return slot

    def temp(self, name: str = "tmp") -> int:
        return self.graph.add_slot(name, SlotKind.TEMP, UNTYPED_TENSOR)

    # -- attributes -------------------------------------------------------------------
    def int_or_ref(self, iov: Any) -> Union[int, SlotRef]:
        if iov is None:
            raise FormatError("a node is missing a required integer")
        return self.value(iov.vid) if iov.isVid else int(iov.literal)

    def ints_or_refs(self, items: Any) -> tuple[Union[int, SlotRef], ...]:
        return tuple(self.int_or_ref(i) for i in items or ())

    def static_int(self, iov: Any, what: str) -> int:
        value = self.int_or_ref(iov)
        if isinstance(value, SlotRef):
            raise FormatError(f"{what} computed at run time is not supported")
        return value

    def static_float(self, fov: Any, what: str) -> float:
        if fov is None or fov.isVid:
            raise FormatError(f"{what} must be a literal")
        return float(fov.literal)

    @staticmethod
    def dtype(code: Optional[int]) -> str:
        try:
            return SCALAR_TYPES[code]  # type: ignore[index]
        except KeyError:
            raise FormatError(f"ExecuTorch scalar type {code} is not a dtype mlx-pte runs") from None

    @staticmethod
    def text(raw: Any) -> str:
        try:
            return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
        except UnicodeDecodeError:
            raise FormatError("a node's string attribute is not valid UTF-8") from None

    def cache_id(self, layer_id: Optional[int]) -> int:
        if layer_id is None or layer_id < 0 or (self._n_caches is not None and layer_id >= self._n_caches):
            raise FormatError(
                f"UpdateAndAttendNode names cache {layer_id}; the program publishes {self._n_caches} caches"
            )
        return layer_id

    # -- emitting ---------------------------------------------------------------------
    def emit(self, op: str, inputs: tuple[Optional[int], ...], outputs: tuple[int, ...], **attrs: AttrValue) -> None:
        self.graph.instructions.append(Instruction(op, inputs, outputs, tuple(attrs.items())))

    def constant_dtype(self, slot: int) -> Optional[str]:
        """A constant slot's dtype; None for any other slot (temps carry no type)."""
        return self.graph.slots[slot].type.dtype if slot in self._constants else None

    def scaled(self, slot: int, factor: float, dtype: str) -> int:
        """``slot * factor``, the factor made in ``dtype``."""
        if factor == 1.0:
            return slot
        scalar = self.temp()
        self.emit("full", (), (scalar,), shape=(), value=float(factor), dtype=dtype)
        out = self.temp()
        self.emit("mul", (slot, scalar), (out,))
        return out

    def note_transpose(self, out: int, x: int, perm: tuple[int, ...]) -> None:
        if perm == (1, 0) and x in self._constants:
            self._transposed[out] = x

    def transposed_constant(self, tid: Any) -> Optional[int]:
        """The constant slot whose transpose ``tid`` holds, if it holds one."""
        return self._transposed.get(self.read(tid))

    def recorded_shape(self, tid: Any) -> Optional[tuple[int, ...]]:
        """The shape the payload records for tensor ``tid``, a dynamic size as -1 (None when
        it records none: only constants, inputs and outputs have one)."""
        index = -1 if tid is None else tid.idx
        m = self._meta[index] if 0 <= index < len(self._meta) else None
        return None if m is None or m.shape is None else tuple(int(d.value) for d in m.shape)

    def note_rows(self, out: int, x: int, indices: int) -> None:
        if x in self._constants:
            self._rows[out] = (x, indices)

    def constant_rows(self, tid: Any) -> Optional[tuple[int, int]]:
        """(constant slot, indices slot) when ``tid`` holds the rows ``indices`` select of a
        constant (a gather along axis 0), else None."""
        return self._rows.get(self.read(tid))
