"""One rotary op for the queries and keys of a fused projection, applied at load.

A fused q/k/v projection is cut into head groups by one ``split_heads``; queries and keys
are then rotated by two ``rope`` ops with the same positions and frequencies. RoPE rotates
each head on its own, so one ``rope`` over both groups' heads followed by a ``split`` of
its result (views) gives the same values with one rotary kernel per layer instead of two,
and fewer primitives for the host to encode every step.

This runs on the graph a process loads (after a tensor-parallel shard is cut, whose head
groups it leaves intact), not at export: a file keeps q and k as separate groups, so a
shard still finds each group's heads where the export put them.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from .catalog import lookup
from .graph import Graph, Instruction, SlotKind, TensorType
from .passes import readers_of, with_replacements


def rotate_heads_together(graph: Graph) -> Graph:
    """``graph`` with each pair of ``rope`` ops over adjacent ``split_heads`` groups merged
    (``graph`` itself is not changed; new slots are appended)."""
    graph = replace(graph, slots=list(graph.slots), instructions=list(graph.instructions))
    readers = readers_of(graph.instructions)
    replaced: dict[int, list[Instruction]] = {}  # id of an instruction -> what takes its place
    for instr in graph.instructions:
        if instr.op == "split_heads":
            replaced.update(_merge_rotated_pair(graph, instr, readers))
    return with_replacements(graph, replaced)


def _merge_rotated_pair(graph: Graph, split: Instruction, readers: dict[int, list[Instruction]]
                        ) -> dict[int, list[Instruction]]:
    """The replacements merging the first two groups of ``split`` that two identical
    ``rope`` ops read (and nothing else), adjacent or with one unread group between them
    (the padding that keeps a fused projection's parts aligned; it is rotated too, and
    dropped); empty when there are none."""
    heads = split.attr("heads")
    assert isinstance(heads, tuple)
    parts = split.outputs
    for i in range(len(parts) - 1):
        first = _only_rope(graph, parts[i], readers)
        if first is None:
            continue
        for j in (i + 1, i + 2):
            if j >= len(parts) or (j == i + 2 and (readers.get(parts[i + 1]) or parts[i + 1] in graph.outputs)):
                break
            second = _only_rope(graph, parts[j], readers)
            if second is None or first.inputs[1:] != second.inputs[1:] or first.attrs != second.attrs:
                continue
            together = sum(heads[i : j + 1])
            part_type = _with_heads(graph, parts[i], together)
            rotated_type = _with_heads(graph, first.outputs[0], together)
            if part_type is None or rotated_type is None:
                continue
            part = graph.add_slot(_joined(graph, parts[i], parts[j]), SlotKind.TEMP, part_type)
            rotated = graph.add_slot(_joined(graph, first.outputs[0], second.outputs[0]), SlotKind.TEMP, rotated_type)
            grouped = replace(
                split,
                outputs=(*parts[:i], part, *parts[j + 1 :]),
                attrs=tuple((k, (*heads[:i], together, *heads[j + 1 :]) if k == "heads" else v) for k, v in split.attrs),
            )
            rope = replace(first, inputs=(part, *first.inputs[1:]), outputs=(rotated,))
            # The padding's old slot (unread) takes its rotated heads.
            cut = Instruction("split", (rotated,), (first.outputs[0], *parts[i + 1 : j], second.outputs[0]),
                              (("sizes", heads[i : j + 1]), ("dim", 1)))
            for instr in (grouped, rope, cut):
                lookup(instr.op).validate(instr, graph)
            return {id(split): [grouped], id(first): [rope, cut], id(second): []}
    return {}


def _only_rope(graph: Graph, part: int, readers: dict[int, list[Instruction]]) -> Optional[Instruction]:
    """The ``rope`` that is the only reader of ``part``, rotating along axis 2 ([B, H, T, D])."""
    read = readers.get(part, [])
    if len(read) != 1 or part in graph.outputs:
        return None
    rope = read[0]
    if rope.op != "rope" or rope.inputs[0] != part or rope.attr("seq_axis") != 2 or rope.outputs[0] in graph.outputs:
        return None
    return rope


def _with_heads(graph: Graph, slot: int, heads: int) -> Optional[TensorType]:
    """``slot``'s type ([B, H, T, D]) with ``heads`` heads (untyped stays untyped: a shard's
    rank-local values), or None when it is typed otherwise."""
    t = graph.slots[slot].type
    if not isinstance(t, TensorType) or (t.shape is not None and len(t.shape) != 4):
        return None
    return t if t.shape is None else TensorType(t.dtype, (t.shape[0], heads, *t.shape[2:]))


def _joined(graph: Graph, a: int, b: int) -> str:
    return f"{graph.slots[a].name}+{graph.slots[b].name}"
