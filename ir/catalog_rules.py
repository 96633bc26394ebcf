"""The attribute rules of the op catalog (``ir.catalog``): what an attribute's value must
satisfy given the declared types of the instruction's operands and results (an axis of
the operand, a permutation, sizes that match the result). ``RULES`` maps a rule's name, as
an ``AttrSpec`` gives it, to its check.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .graph import UNTYPED_TENSOR, Graph, Instruction, SymDim, TensorType


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Shapes:
    """The declared shapes an instruction's rules read (operands in order, then results)."""

    instr: Instruction
    graph: Graph

    def _shape(self, slot: Optional[int]) -> Optional[tuple]:
        t = self.graph.slots[slot].type if slot is not None else None
        return t.shape if isinstance(t, TensorType) else None

    @property
    def typed(self) -> bool:
        """Whether every tensor the rules read records its shape. Temps of an imported upstream
        program record none (``graph.UNTYPED_TENSOR``); their attributes meet the shapes when
        the handlers run."""
        slots = [s for s in (*self.instr.inputs, *self.instr.outputs) if s is not None]
        return all(self.graph.slots[s].type != UNTYPED_TENSOR for s in slots)

    @property
    def rank(self) -> int:
        """The first operand's rank (0 for an op without operands)."""
        return len(self._shape(self.instr.inputs[0]) or ()) if self.instr.inputs else 0

    @property
    def result(self) -> Optional[tuple]:
        """The first result's declared shape (None for a scalar result)."""
        return self._shape(self.instr.outputs[0]) if self.instr.outputs else None


def _axes(values: Sequence[int], bound: int, what: str) -> Optional[str]:
    bad = [v for v in values if not 0 <= v < bound]
    return f"{what} {bad[0]} is outside [0, {bound})" if bad else None


def _literals(value: object) -> list[int]:
    items = value if isinstance(value, tuple) else (value,)
    return [v for v in items if is_int(v)]


def _matches_result(value: tuple, shapes: Shapes, keep: bool = False) -> Optional[str]:
    """``value`` (a shape attribute) has the result's rank and its static sizes; with ``keep``,
    -1 (view: the inferred size; expand: the operand's size) is not compared."""
    result = shapes.result
    if result is None or len(value) != len(result):
        return f"has {len(value)} entries, the result has rank {len(result or ())}"
    for size, dim in zip(value, result):
        if not is_int(size) or (keep and size == -1):
            continue
        if isinstance(dim, SymDim):
            if size < dim.min or (dim.max is not None and size > dim.max):
                return f"size {size} is outside the result's range for {dim.name}"
        elif size != dim:
            return f"size {size} differs from the result's {dim}"
    return None


def _shape_rule(lowest: int, most_minus_one: Optional[int], match: bool, keep: bool = False) -> Callable:
    def rule(value: tuple, shapes: Shapes) -> Optional[str]:
        low = [v for v in _literals(value) if v < lowest]
        if low:
            return f"size {low[0]} is negative" if lowest == 0 else f"size {low[0]} is below {lowest}"
        if most_minus_one is not None and _literals(value).count(-1) > most_minus_one:
            return "holds more than one -1"
        return _matches_result(value, shapes, keep) if match else None

    return rule


def _permutation_of(value: tuple, rank: int, of: str) -> Optional[str]:
    return None if sorted(value) == list(range(rank)) else f"is not a permutation of the {rank} axes of the {of}"


def _permutation(value: tuple, shapes: Shapes) -> Optional[str]:
    return _permutation_of(value, shapes.rank, "operand")


def _result_permutation(value: tuple, shapes: Shapes) -> Optional[str]:
    """A permutation of the result's axes (``view_permute`` permutes the viewed shape, whose
    rank is the result's, not the operand's)."""
    return _permutation_of(value, len(shapes.result or ()), "result")


def _split_heads_shape(value: tuple, shapes: Shapes) -> Optional[str]:
    """``view_permute``'s shape: one -1 at most, and, permuted by its dims, the result's shape
    (dims that are no permutation of it are the dims rule's to report)."""
    problem = _shape_rule(-1, 1, match=False)(value, shapes)
    dims = dict(shapes.instr.attrs).get("dims")
    if problem or not (isinstance(dims, tuple) and all(is_int(d) for d in dims)) \
            or sorted(dims) != list(range(len(value))):
        return problem
    return _matches_result(tuple(value[d] for d in dims), shapes, keep=True)


def _seq_axis(value: int, shapes: Shapes) -> Optional[str]:
    return None if value in (1, 2) else "must be 1 ([1, T, H, D]) or 2 ([1, H, T, D])"


def _sorted_axes(value: tuple, shapes: Shapes) -> Optional[str]:
    if list(value) != sorted(set(value)):
        return "must list distinct axes in increasing order"
    return _axes(value, shapes.rank, "axis")


def _same_rank(value: int, shapes: Shapes) -> Optional[str]:
    ranks = {len(shapes._shape(s) or ()) for s in shapes.instr.inputs}
    return _axes([value], shapes.rank, "axis") if len(ranks) == 1 else "joins operands of different ranks"


def _tile_reps(value: tuple, shapes: Shapes) -> Optional[str]:
    low = [v for v in _literals(value) if v < 0]
    if low:
        return f"count {low[0]} is negative"
    result = shapes.result
    if result is not None and len(result) != max(len(value), shapes.rank):
        return f"has {len(value)} entries for an operand of rank {shapes.rank} and a result of rank {len(result)}"
    return None


# rule name -> check(value, shapes) -> the problem, or None. Refs (dynamic sizes) are checked
# when they are read at run time; these rules see the literal parts.
RULES: dict[str, Callable[[object, Shapes], Optional[str]]] = {
    "axis": lambda v, s: _axes([v], s.rank, "axis"),  # an axis of the first operand
    "new_axis": lambda v, s: _axes([v], s.rank + 1, "axis"),  # where an axis is inserted
    "sorted_axes": _sorted_axes,
    "squeeze_axes": lambda v, s: _axes(v, s.rank, "axis"),
    "cat_axis": _same_rank,
    "permutation": _permutation,
    "result_permutation": _result_permutation,
    "nonzero": lambda v, s: "must not be 0" if is_int(v) and v == 0 else None,
    "sizes": _shape_rule(0, None, match=False),
    "result_shape": _shape_rule(0, None, match=True),  # the created tensor's shape
    "view_shape": _shape_rule(-1, 1, match=True, keep=True),
    "split_heads_shape": _split_heads_shape,
    "seq_axis": _seq_axis,
    "expand_shape": _shape_rule(-1, None, match=True, keep=True),
    "tile_reps": _tile_reps,
}
