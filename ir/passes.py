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
- **fused-projection splits**: a ``split`` of a fused q/k/v projection whose parts are
  each head-split by a ``view_permute`` (or unread: padding) becomes one ``split_heads``
  (one reshape and transpose for all parts), and a ``split`` of a fused gate/up projection
  into gate, padding and up, read only by a ``glu``, folds into that ``glu``;
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
    graph = replace(graph, outputs=list(graph.outputs), slots=list(graph.slots))
    instructions = _fold_aliases(graph, graph.instructions)
    instructions = _merge_common(graph, instructions)
    instructions = _fuse_layout_pairs(graph, instructions)
    instructions = _fuse_projection_splits(graph, instructions)
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


# -- fused-projection splits ----------------------------------------------------------
def _fuse_projection_splits(graph: Graph, instructions: list[Instruction]) -> list[Instruction]:
    readers = readers_of(instructions)
    replaced: dict[int, Optional[Instruction]] = {}  # id of an instruction -> its replacement (None: gone)
    for instr in instructions:
        if instr.op != "split" or any(s in graph.outputs for s in instr.outputs):
            continue
        rewrite = _head_split(graph, instr, readers) or _glu_halves(graph, instr, readers)
        if rewrite is not None:
            fused, absorbed = rewrite
            replaced[id(instr)] = fused
            replaced.update((id(r), None) for r in absorbed)
    out = []
    for instr in instructions:
        new = replaced.get(id(instr), instr)
        if new is not None:
            out.append(new)
    return out


def _last_axis_parts(graph: Graph, split: Instruction) -> Optional[tuple[TensorType, tuple[int, ...]]]:
    """A split's operand type and static sizes, when it cuts the last axis of a rank-3 tensor."""
    t = _tensor(graph, split.inputs[0])  # type: ignore[arg-type]
    sizes = split.attr("sizes")
    if t is None or t.shape is None or len(t.shape) != 3 or split.attr("dim") not in (2, -1):
        return None
    if not isinstance(sizes, tuple) or not all(isinstance(n, int) for n in sizes):
        return None
    return t, sizes  # type: ignore[return-value]


def _head_split(graph: Graph, split: Instruction, readers: dict[int, list[Instruction]]
                ) -> Optional[tuple[Instruction, list[Instruction]]]:
    """split → view_permute per part (unread parts: padding) as one ``split_heads``."""
    found = _last_axis_parts(graph, split)
    if found is None:
        return None
    t, sizes = found
    heads: list[Instruction] = []
    outputs: list[int] = []
    dim: Optional[int] = None
    for part, size in zip(split.outputs, sizes):
        read = readers.get(part, [])
        if not read:
            outputs.append(part)  # padding: retyped below once the head size is known
            continue
        reader = read[0]
        shape = reader.attr("shape")
        if len(read) != 1 or reader.op != "view_permute" or reader.attr("dims") != (0, 2, 1, 3) \
                or not isinstance(shape, tuple) or len(shape) != 4 or not isinstance(shape[3], int):
            return None
        if dim is not None and shape[3] != dim:
            return None
        dim = shape[3]
        result = _tensor(graph, reader.outputs[0])
        if dim < 1 or size % dim or result is None or result.shape != (t.shape[0], size // dim, t.shape[1], dim):  # type: ignore[index]
            return None
        heads.append(reader)
        outputs.append(reader.outputs[0])
    if dim is None or any(size % dim for size in sizes):
        return None
    for part, size in zip(split.outputs, sizes):
        if not readers.get(part):
            head_type = TensorType(t.dtype, (t.shape[0], size // dim, t.shape[1], dim))  # type: ignore[index]
            graph.slots[part] = replace(graph.slots[part], type=head_type)
    fused = Instruction("split_heads", split.inputs, tuple(outputs),
                        (("head_dim", dim), ("heads", tuple(size // dim for size in sizes))))
    lookup("split_heads").validate(fused, graph)
    return fused, heads


def _glu_halves(graph: Graph, split: Instruction, readers: dict[int, list[Instruction]]
                ) -> Optional[tuple[Instruction, list[Instruction]]]:
    """split into (gate, padding?, up) of equal gate and up widths, read only by one glu as
    (gate, up) → that glu on the whole, with the width."""
    found = _last_axis_parts(graph, split)
    if found is None or len(found[1]) not in (2, 3) or found[1][0] != found[1][-1]:
        return None
    gate, up = split.outputs[0], split.outputs[-1]
    read_gate, read_up = readers.get(gate, []), readers.get(up, [])
    if len(read_gate) != 1 or read_up != read_gate or (len(split.outputs) == 3 and readers.get(split.outputs[1])):
        return None
    glu = read_gate[0]
    if glu.op != "glu" or tuple(glu.inputs[:2]) != (gate, up):
        return None
    fused = replace(glu, inputs=split.inputs, attrs=(*glu.attrs, ("width", found[1][0])))
    lookup("glu").validate(fused, graph)
    return fused, [glu]


def readers_of(instructions: list[Instruction]) -> dict[int, list[Instruction]]:
    """Slot → the instructions that read it (as an operand or a size attribute), in order."""
    readers: dict[int, list[Instruction]] = {}
    for instr in instructions:
        for s in _reads(instr):
            readers.setdefault(s, []).append(instr)
    return readers


def with_replacements(graph: Graph, replaced: Mapping[int, list[Instruction]]) -> Graph:
    """``graph`` with each instruction whose ``id`` is a key of ``replaced`` replaced, in
    place, by that key's list (empty: removed); ``graph`` itself when there are none."""
    if not replaced:
        return graph
    instructions = []
    for instr in graph.instructions:
        instructions.extend(replaced.get(id(instr), [instr]))
    return replace(graph, instructions=instructions)


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
