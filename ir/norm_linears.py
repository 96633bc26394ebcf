"""An rms_norm and the one linear that reads it as one op, applied at load.

A decoder layer normalizes its residual stream twice, and each norm feeds one fused
projection (q/k/v, gate/up); the model's final norm feeds the LM head. On a GPU at one
token a step, the residual add, the norm and the linear are three kernels and three graph
nodes the host encodes every step, where the linear's kernel can normalize the row itself
(``runtime/mlx/gemv.py``). So an ``rms_norm`` (with a weight, no cast) read only by one
``linear`` (as its input; its weight and bias constants) becomes ``rms_norm_linear``; when
the norm's input is an ``add`` of two operands, the add joins it as
``add_rms_norm_linear``, whose second result is the sum (the residual the layer reads
again). A ``quantized_linear`` joins its norm alike, as ``rms_norm_quantized_linear`` and
``add_rms_norm_quantized_linear``. The fused ops run the three ops' exact rules wherever
the kernel does not apply.

The model's final norm is followed by the selection of the rows the LM head reads (one a
step at decode). A norm works row by row, so the selection moves before it first: the
norm then normalizes only the selected rows and its one reader is the LM head's linear.

Like ``rotary_pairs``, this runs on the graph a process loads (after a tensor-parallel
shard is cut), not at export: files keep the ops the exporter wrote.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from .catalog import lookup
from .graph import Graph, Instruction, SlotKind
from .passes import readers_of, with_replacements


def fuse_norm_linears(graph: Graph) -> Graph:
    """``graph`` with each norm-then-linear (and the residual add before it) as one op
    (``graph`` itself is not changed)."""
    graph = _select_rows_first(graph)
    readers = readers_of(graph.instructions)
    producer = {slot: instr for instr in graph.instructions for slot in instr.outputs}
    replaced: dict[int, list[Instruction]] = {}  # id of an instruction -> what takes its place
    for norm in graph.instructions:
        linear = _only_linear(graph, norm, readers)
        if linear is None:
            continue
        add = producer.get(norm.inputs[0])
        # A quantized linear keeps its attributes (its weight's type) on the fused op.
        attrs = (("eps", norm.attr("eps")), *linear.attrs)
        op = f"rms_norm_{linear.op}"
        if add is not None and add.op == "add" and id(add) not in replaced and _is_constant(graph, norm.inputs[1]):
            fused = Instruction(f"add_{op}", (*add.inputs, norm.inputs[1], *linear.inputs[1:]),
                                (linear.outputs[0], add.outputs[0]), attrs)
            # The sum may be read before the linear ran: the fused op takes the add's place,
            # where the norm's weight and the linear's (constants) are as ready as later.
            first = add
        else:
            fused = Instruction(op, (norm.inputs[0], norm.inputs[1], *linear.inputs[1:]), (linear.outputs[0],), attrs)
            first = norm
        lookup(fused.op).validate(fused, graph)
        replaced.update({id(instr): [] for instr in ((add, norm, linear) if first is add else (norm, linear))})
        replaced[id(first)] = [fused]
    return with_replacements(graph, replaced)


_LINEARS = ("linear", "quantized_linear")
# Ops that pick rows along one axis: before a norm over the last axis they commute with it.
_ROW_SELECTIONS = frozenset({"select", "index_select", "slice"})


def _select_rows_first(graph: Graph) -> Graph:
    """``graph`` with each rms_norm read only by a row selection (along an axis other than
    the normalized last one) run after that selection instead, until no such pair is left:
    the selection reads the norm's input and the norm the selected rows."""
    while True:
        readers = readers_of(graph.instructions)
        pair = next(((norm, readers[norm.outputs[0]][0]) for norm in graph.instructions
                     if _selected_first(graph, norm, readers)), None)
        if pair is None:
            return graph
        norm, selection = pair
        normed, selected = norm.outputs[0], selection.outputs[0]
        # The norm's slot now holds the selected rows (typed as the selection's result,
        # which a norm does not change); the selection's slot, the normalized ones.
        slots = list(graph.slots)
        slots[normed] = replace(slots[normed], type=slots[selected].type)
        moved = [replace(selection, inputs=(norm.inputs[0], *selection.inputs[1:]), outputs=(normed,)),
                 replace(norm, inputs=(normed, *norm.inputs[1:]), outputs=(selected,))]
        graph = with_replacements(replace(graph, slots=slots), {id(norm): [], id(selection): moved})


def _selected_first(graph: Graph, norm: Instruction, readers: dict[int, list[Instruction]]) -> bool:
    """Whether ``norm`` is an rms_norm whose result only one row selection reads, along an
    axis (of a known rank) other than the last."""
    if norm.op != "rms_norm" or norm.outputs[0] in graph.outputs:
        return False
    read = readers.get(norm.outputs[0], [])
    if len(read) != 1 or read[0].op not in _ROW_SELECTIONS or read[0].inputs[0] != norm.outputs[0]:
        return False
    shape = graph.slots[norm.outputs[0]].type.shape
    if shape is None:
        return False
    dim = read[0].attr("dim")
    return (dim if dim >= 0 else dim + len(shape)) != len(shape) - 1


def _only_linear(graph: Graph, norm: Instruction, readers: dict[int, list[Instruction]]) -> Optional[Instruction]:
    """The linear that alone reads ``norm``'s result, when ``norm`` is an rms_norm with a
    weight and no cast."""
    if norm.op != "rms_norm" or len(norm.inputs) < 2 or norm.inputs[1] is None or norm.attr("dtype") is not None:
        return None
    return sole_linear_reader(graph, norm.outputs[0], readers)


def sole_linear_reader(graph: Graph, slot: int, readers: dict[int, list[Instruction]]) -> Optional[Instruction]:
    """The ``linear`` or ``quantized_linear`` that alone reads ``slot`` (a temp, not a
    result of the graph), as its input, with constants for its weight and bias: ready
    wherever an op fused from it and the slot's producer is placed."""
    read = readers.get(slot, [])
    if len(read) != 1 or slot in graph.outputs:
        return None
    linear = read[0]
    if linear.op not in _LINEARS or linear.inputs[0] != slot or slot in linear.inputs[1:]:
        return None
    if not all(operand is None or _is_constant(graph, operand) for operand in linear.inputs[1:]):
        return None
    return linear


def _is_constant(graph: Graph, slot: int) -> bool:
    return graph.slots[slot].kind is SlotKind.CONSTANT
