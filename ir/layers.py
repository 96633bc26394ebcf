"""How many instructions each decoder layer of a program costs.

A decoder layer runs exactly one ``update_and_attend``, so the instructions from one
attention call up to the next are one layer's worth (the second half of layer i and the
first half of layer i + 1). This needs no naming convention; the span before the first
call and after the last hold the embedding, the first layer's head, the last layer's
tail, the final norm and the LM head.
"""
from __future__ import annotations

from dataclasses import dataclass

from .fuse_projections import linear_count
from .graph import Graph

ATTEND = "update_and_attend"


@dataclass(frozen=True)
class LayerCounts:
    total: int  # instructions in the whole program
    layers: int  # attention calls
    spans: tuple[int, ...]  # instructions from each attention call to the next (layers - 1 spans)
    matmuls: tuple[int, ...]  # matmuls on weights (linear, quantized_linear) in each span

    def summary(self) -> str:
        """One line for ``mlx-pte inspect``."""
        if not self.spans:
            return f"per decoder layer: n/a ({self.layers} attention layer{'s' if self.layers != 1 else ''})"
        return (
            f"per decoder layer: {_figure(self.spans)} instructions, {_figure(self.matmuls)} matmuls "
            f"({len(self.spans)} spans between consecutive {ATTEND})"
        )


def _figure(counts: tuple[int, ...]) -> str:
    lo, hi = min(counts), max(counts)
    return str(lo) if lo == hi else f"{lo}-{hi} (mean {sum(counts) / len(counts):.1f})"


def layer_counts(graph: Graph) -> LayerCounts:
    calls = [i for i, instr in enumerate(graph.instructions) if instr.op == ATTEND]
    spans = tuple(b - a for a, b in zip(calls, calls[1:]))
    matmuls = tuple(linear_count(graph.instructions[a:b]) for a, b in zip(calls, calls[1:]))
    return LayerCounts(len(graph.instructions), len(calls), spans, matmuls)
