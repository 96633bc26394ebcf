"""Graph rewrites that keep every value exact: fewer instructions, the same numbers.

``simplify`` runs them in order on a lowered graph:

- **aliases**: casts to the dtype a value already has, float widen-then-narrow round
  trips (bf16 → f32 → bf16 is exact), views to the shape their source already has (also
  through one reshape-like op: view/unsqueeze/squeeze), and inverse permute pairs cancel;
- **common subexpressions**: an instruction equal to an earlier one (same op, operands
  and attributes) reuses its results (HF recomputes the same unsqueeze of the rotary
  tables and the same view of the positions in every layer);
- **layout pairs**: a view read only by a permute (a head split) or a permute read only by
  a view (a head merge) become one ``view_permute`` / ``permute_view``;
- **dead code**: instructions whose results nothing reads (the KV-cache op always runs);
- **compaction**: slots nothing refers to any more are dropped and the rest renumbered.

Every rewrite is local and checks the types it relies on; anything else is left alone.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping, Optional

import numpy as np

from .catalog import lookup
from .graph import AttrValue, Graph, Instruction, Slot, SlotKind, SlotRef, TensorType

# Ops with an effect besides their result: never removed or merged.
EFFECTFUL = frozenset({"update_and_attend"})
# Float conversions that lose nothing, so converting back restores the value.
_EXACT_WIDENING = {("bfloat16", "float32"), ("float16", "float32")}
_RESHAPES = frozenset({"view", "unsqueeze", "squeeze"})

Constants = dict[int, np.ndarray]


def simplify(graph: Graph, constants: Mapping[int, np.ndarray]) -> tuple[Graph, Constants]:
    """``graph`` with the rewrites above applied, and its constants renumbered to match
    (``graph`` itself is not changed)."""
    graph = replace(graph, outputs=list(graph.outputs))
    instructions = _fold_aliases(graph, graph.instructions)
    instructions = _merge_common(graph, instructions)
    instructions = _fuse_layout_pairs(graph, instructions)
    instructions = _drop_dead(graph, instructions)
    return compact(replace(graph, instructions=instructions), constants)


# -- slot substitution -----------------------------------------------------------------
class _Renames:
    """Slot → the slot now holding its value (chains resolved)."""

    def __init__(self) -> None:
        self._to: dict[int, int] = {}

    def add(self, old: int, new: int) -> None:
        self._to[old] = self(new)

    def __call__(self, slot: int) -> int:
        while slot in self._to:
            slot = self._to[slot]
        return slot

    def apply(self, instr: Instruction) -> Instruction:
        inputs = tuple(None if s is None else self(s) for s in instr.inputs)
        attrs = tuple((k, self._attr(v)) for k, v in instr.attrs)
        return replace(instr, inputs=inputs, attrs=attrs)

    def _attr(self, value: AttrValue) -> AttrValue:
        if isinstance(value, SlotRef):
            return SlotRef(self(value.slot))
        if isinstance(value, tuple):
            return tuple(self._attr(v) for v in value)  # type: ignore[misc]
        return value


def _rewrite(
    graph: Graph, instructions: list[Instruction], step: Callable[[Instruction, dict[int, Instruction]], Optional[int]]
) -> list[Instruction]:
    """Apply ``step`` to each instruction (operands already renamed): it returns the slot
    that replaces the instruction's single result, or None to keep it. Graph outputs are
    renamed to match."""
    renames = _Renames()
    producer: dict[int, Instruction] = {}
    out: list[Instruction] = []
    for instr in instructions:
        instr = renames.apply(instr)
        same = step(instr, producer) if instr.op not in EFFECTFUL else None
        if same is not None:
            renames.add(instr.outputs[0], same)
            continue
        out.append(instr)
        for s in instr.outputs:
            producer[s] = instr
    graph.outputs = [renames(s) for s in graph.outputs]
    return out


def _tensor(graph: Graph, slot: int) -> Optional[TensorType]:
    t = graph.slots[slot].type
    return t if isinstance(t, TensorType) else None


# -- aliases ---------------------------------------------------------------------------
def _fold_aliases(graph: Graph, instructions: list[Instruction]) -> list[Instruction]:
    def step(instr: Instruction, producer: dict[int, Instruction]) -> Optional[int]:
        if len(instr.outputs) != 1 or not instr.inputs or instr.inputs[0] is None:
            return None
        (out,) = instr.outputs
        src = instr.inputs[0]
        source = producer.get(src)
        if instr.op == "cast":
            return _cast_alias(graph, instr, src, source)
        if instr.op == "view":
            return _view_alias(graph, out, src, source)
        if instr.op == "permute":
            return _permute_alias(instr, source)
        return None

    return _rewrite(graph, instructions, step)


def _cast_alias(graph: Graph, instr: Instruction, src: int, source: Optional[Instruction]) -> Optional[int]:
    target = instr.attr("dtype")
    src_type = _tensor(graph, src)
    if src_type is not None and src_type.dtype == target:
        return src
    if source is not None and source.op == "cast" and source.inputs[0] is not None:
        origin = source.inputs[0]
        origin_type = _tensor(graph, origin)
        if origin_type is not None and origin_type.dtype == target and (target, source.attr("dtype")) in _EXACT_WIDENING:
            return origin
    return None


def _view_alias(graph: Graph, out: int, src: int, source: Optional[Instruction]) -> Optional[int]:
    out_type = _tensor(graph, out)
    if source is not None and source.op in _RESHAPES and source.inputs[0] is not None:
        # A reshape of a reshape reads its source's elements in the same row-major order.
        origin = source.inputs[0]
        if out_type is not None and out_type.shape == _shape(graph, origin):
            return origin
    return src if out_type is not None and out_type.shape == _shape(graph, src) else None


def _shape(graph: Graph, slot: int) -> Optional[tuple]:
    t = _tensor(graph, slot)
    return None if t is None else t.shape


def _permute_alias(instr: Instruction, source: Optional[Instruction]) -> Optional[int]:
    if source is None or source.op != "permute" or source.inputs[0] is None:
        return None
    inner, outer = source.attr("dims"), instr.attr("dims")
    assert isinstance(inner, tuple) and isinstance(outer, tuple)
    composed = tuple(inner[d] for d in outer)
    return source.inputs[0] if composed == tuple(range(len(composed))) else None


# -- common subexpressions -------------------------------------------------------------
def _merge_common(graph: Graph, instructions: list[Instruction]) -> list[Instruction]:
    renames = _Renames()
    seen: dict[tuple, tuple[int, ...]] = {}
    out: list[Instruction] = []
    for instr in instructions:
        instr = renames.apply(instr)
        key = (instr.op, instr.inputs, instr.attrs, tuple(graph.slots[s].type for s in instr.outputs))
        if instr.op not in EFFECTFUL and key in seen:
            for old, new in zip(instr.outputs, seen[key]):
                renames.add(old, new)
            continue
        seen[key] = instr.outputs
        out.append(instr)
    graph.outputs = [renames(s) for s in graph.outputs]
    return out


# -- layout pairs ----------------------------------------------------------------------
_PAIRS = {("view", "permute"): "view_permute", ("permute", "view"): "permute_view"}


def _fuse_layout_pairs(graph: Graph, instructions: list[Instruction]) -> list[Instruction]:
    readers = _readers(graph, instructions)
    producer = {s: instr for instr in instructions for s in instr.outputs}
    fused_away: set[int] = set()  # ids of first halves merged into their reader
    out: list[Instruction] = []
    for instr in instructions:
        src = instr.inputs[0] if instr.inputs else None
        first = producer.get(src) if src is not None else None
        op = _PAIRS.get((first.op, instr.op)) if first is not None else None
        if op is None or readers.get(src, 0) != 1 or src in graph.outputs:
            out.append(instr)
            continue
        assert first is not None
        shape = first.attr("shape") if first.op == "view" else instr.attr("shape")
        dims = first.attr("dims") if first.op == "permute" else instr.attr("dims")
        fused = Instruction(op, first.inputs, instr.outputs, (("shape", shape), ("dims", dims)))
        lookup(op).validate(fused, graph)
        fused_away.add(id(first))
        out.append(fused)
    return [instr for instr in out if id(instr) not in fused_away]


def _readers(graph: Graph, instructions: list[Instruction]) -> dict[int, int]:
    """How many operand (and size-attribute) reads each slot has."""
    count: dict[int, int] = {}
    for instr in instructions:
        for s in _reads(instr):
            count[s] = count.get(s, 0) + 1
    return count


def _reads(instr: Instruction) -> list[int]:
    reads = [s for s in instr.inputs if s is not None]
    for _, value in instr.attrs:
        items = value if isinstance(value, tuple) else (value,)
        reads.extend(v.slot for v in items if isinstance(v, SlotRef))
    return reads


# -- dead code and compaction ----------------------------------------------------------
def _drop_dead(graph: Graph, instructions: list[Instruction]) -> list[Instruction]:
    live = set(graph.outputs)
    kept: list[Instruction] = []
    for instr in reversed(instructions):
        if instr.op in EFFECTFUL or live.intersection(instr.outputs):
            kept.append(instr)
            live.update(_reads(instr))
    return kept[::-1]


def compact(graph: Graph, constants: Mapping[int, np.ndarray]) -> tuple[Graph, Constants]:
    """``graph`` without the slots nothing refers to, the rest renumbered (and
    ``constants`` with them)."""
    used = set(graph.inputs) | set(graph.outputs)
    for instr in graph.instructions:
        used.update(_reads(instr))
        used.update(instr.outputs)
    keep = [s for s in range(len(graph.slots)) if s in used]
    new = {old: i for i, old in enumerate(keep)}
    slots: list[Slot] = [graph.slots[s] for s in keep]
    instructions = [
        Instruction(
            instr.op,
            tuple(None if s is None else new[s] for s in instr.inputs),
            tuple(new[s] for s in instr.outputs),
            tuple((k, _renumber(v, new)) for k, v in instr.attrs),
        )
        for instr in graph.instructions
    ]
    compacted = Graph(slots, instructions, [new[s] for s in graph.inputs], [new[s] for s in graph.outputs])
    kept_constants = {new[s]: data for s, data in constants.items() if s in new}
    assert all(slots[s].kind is SlotKind.CONSTANT for s in kept_constants)
    return compacted, kept_constants


def _renumber(value: AttrValue, new: Mapping[int, int]) -> AttrValue:
    if isinstance(value, SlotRef):
        return SlotRef(new[value.slot])
    if isinstance(value, tuple):
        return tuple(_renumber(v, new) for v in value)  # type: ignore[misc]
    return value
