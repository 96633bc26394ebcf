"""An rms_norm and the one linear that reads it as one op, applied at load.

A decoder layer normalizes its residual stream twice, and each norm feeds one fused
projection (q/k/v, gate/up); the model's final norm feeds the LM head. On a GPU at one
token a step, the residual add, the norm and the linear are three kernels and three graph
nodes the host encodes every step, where the linear's kernel can normalize the row itself
(``runtime/mlx/gemv.py``). So an ``rms_norm`` (with a weight, no cast) read only by one
``linear`` (as its input; its weight and bias constants) becomes ``rms_norm_linear``; when
the norm's input is an ``add`` of two operands, the add joins it as
``add_rms_norm_linear``, whose second result is the sum (the residual the layer reads
again). The fused ops run the three ops' exact rules wherever the kernel does not apply.

Like ``rotary_pairs``, this runs on the graph a process loads (after a tensor-parallel
shard is cut), not at export: files keep the ops the exporter wrote.
"""
from __future__ import annotations

from typing import Optional

from .catalog import lookup
from .graph import Graph, Instruction, SlotKind
from .passes import readers_of, with_replacements


def fuse_norm_linears(graph: Graph) -> Graph:
    """``graph`` with each norm-then-linear (and the residual add before it) as one op
    (``graph`` itself is not changed)."""
    readers = readers_of(graph.instructions)
    producer = {slot: instr for instr in graph.instructions for slot in instr.outputs}
    replaced: dict[int, list[Instruction]] = {}  # id of an instruction -> what takes its place
    for norm in graph.instructions:
        linear = _only_linear(graph, norm, readers)
        if linear is None:
            continue
        add = producer.get(norm.inputs[0])
        eps = (("eps", norm.attr("eps")),)
        if add is not None and add.op == "add" and id(add) not in replaced and _is_constant(graph, norm.inputs[1]):
            fused = Instruction("add_rms_norm_linear", (*add.inputs, norm.inputs[1], *linear.inputs[1:]),
                                (linear.outputs[0], add.outputs[0]), eps)
            # The sum may be read before the linear ran: the fused op takes the add's place,
            # where the norm's weight and the linear's (constants) are as ready as later.
            first = add
        else:
            fused = Instruction("rms_norm_linear", (norm.inputs[0], norm.inputs[1], *linear.inputs[1:]),
                                (linear.outputs[0],), eps)
            first = norm
        lookup(fused.op).validate(fused, graph)
        replaced.update({id(instr): [] for instr in ((add, norm, linear) if first is add else (norm, linear))})
        replaced[id(first)] = [fused]
    return with_replacements(graph, replaced)


def _only_linear(graph: Graph, norm: Instruction, readers: dict[int, list[Instruction]]) -> Optional[Instruction]:
    """The ``linear`` that alone reads ``norm``'s result, when ``norm`` is an rms_norm with a
    weight and no cast and the linear's weight and bias are constants (ready wherever the
    fused op is placed)."""
    if norm.op != "rms_norm" or len(norm.inputs) < 2 or norm.inputs[1] is None or norm.attr("dtype") is not None:
        return None
    normed = norm.outputs[0]
    read = readers.get(normed, [])
    if len(read) != 1 or normed in graph.outputs:
        return None
    linear = read[0]
    if linear.op != "linear" or linear.inputs[0] != normed or normed in linear.inputs[1:]:
        return None
    if not all(slot is None or _is_constant(graph, slot) for slot in linear.inputs[1:]):
        return None
    return linear


def _is_constant(graph: Graph, slot: int) -> bool:
    return graph.slots[slot].kind is SlotKind.CONSTANT
