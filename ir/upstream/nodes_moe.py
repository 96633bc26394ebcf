"""Translations of upstream's mixture-of-experts node types: ``GatherMmNode`` and
``GatherQmmNode`` (``gather_mm`` / ``gather_qmm``, ``ir.catalog_moe``), and ``ItemIntNode``,
which reads their sorted-indices flag from a tensor at run time."""
from __future__ import annotations

from typing import Any, Union

from ..graph import SlotRef
from .builder import ImportBuilder
from .nodes import _quantization, translates


def _sorted_flag(b: ImportBuilder, n: Any) -> Union[int, SlotRef]:
    """Upstream's exporter writes the flag (a literal or a host value) and leaves the older
    bool false; a payload with the bool only says it there."""
    if n.sortedIndicesFlag is None:
        return int(bool(n.sortedIndices))
    return b.int_or_ref(n.sortedIndicesFlag)


@translates("GatherMmNode")
def _gather_mm(b: ImportBuilder, n: Any) -> None:
    inputs = (b.read(n.a), b.read(n.b), b.read_optional(n.lhsIndices), b.read_optional(n.rhsIndices))
    b.emit("gather_mm", inputs, (b.write(n.out),), sorted_indices=_sorted_flag(b, n))


@translates("GatherQmmNode")
def _gather_qmm(b: ImportBuilder, n: Any) -> None:
    inputs = (b.read(n.x), b.read(n.w), b.read(n.scales), b.read_optional(n.biases),
              b.read_optional(n.lhsIndices), b.read_optional(n.rhsIndices))  # fmt: skip
    attrs = dict(transpose=bool(n.transpose), sorted_indices=_sorted_flag(b, n), **_quantization(b, n))
    b.emit("gather_qmm", inputs, (b.write(n.out),), **attrs)


@translates("ItemIntNode")
def _item_int(b: ImportBuilder, n: Any) -> None:
    b.emit("item", (b.read(n.x),), (b.write_value(n.out),))
