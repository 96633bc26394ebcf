"""A GLU and the down projection reading it as one op, applied at load.

A gated MLP ends in ``down(act(gate) * up)``. On a GPU at one token a step the ``glu`` is
a kernel and a graph node of its own (two, with the split of a fused gate/up projection)
between two GEMVs, where the down projection's kernel can build act(gate) * up itself
(``runtime/mlx/gemv.py``). So a ``glu`` read only by one ``linear`` (as its input; its
weight and bias constants) becomes ``glu_linear``, and one read by a ``quantized_linear``
becomes ``glu_quantized_linear``. The fused ops run the two ops' exact rules wherever the
kernel does not apply.

Like ``norm_linears``, this runs on the graph a process loads (after a tensor-parallel
shard is cut), not at export: files keep the ops the exporter wrote.
"""
from __future__ import annotations

from .catalog import lookup
from .graph import Graph, Instruction
from .norm_linears import sole_linear_reader
from .passes import readers_of, with_replacements


def fuse_glu_linears(graph: Graph) -> Graph:
    """``graph`` with each glu-then-linear as one op (``graph`` itself is not changed)."""
    readers = readers_of(graph.instructions)
    replaced: dict[int, list[Instruction]] = {}  # id of an instruction -> what takes its place
    for glu in graph.instructions:
        if glu.op != "glu":
            continue
        linear = sole_linear_reader(graph, glu.outputs[0], readers)
        if linear is None:
            continue
        gate, up = glu.inputs[0], glu.inputs[1] if len(glu.inputs) > 1 else None
        fused = Instruction(f"glu_{linear.op}", (gate, up, *linear.inputs[1:]), linear.outputs,
                            (*glu.attrs, *linear.attrs))
        lookup(fused.op).validate(fused, graph)
        # The linear's operands besides the row are constants, as ready at the glu's place.
        replaced[id(glu)] = [fused]
        replaced[id(linear)] = []
    return with_replacements(graph, replaced)
