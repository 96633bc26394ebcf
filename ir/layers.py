"""How many instructions each decoder layer of a program costs.

A decoder layer runs exactly one ``update_and_attend``, so the instructions from one
attention call up to the next are one layer's worth (the second half of layer i and the
first half of layer i + 1). This needs no naming convention; the span before the first
call and after the last hold the embedding, the first layer's head, the last layer's
tail, the final norm and the LM head.
"""
from __future__ import annotations

from dataclasses import dataclass

from .graph import Graph

ATTEND = "update_and_attend"


@dataclass(frozen=True)
class LayerCounts:
    total: int  # instructions in the whole program
    layers: int  # attention calls
    spans: tuple[int, ...]  # instructions from each attention call to the next (layers - 1 spans)

    def summary(self) -> str:
        """One line for ``mlx-pte inspect``."""
        if not self.spans:
            return f"per decoder layer: n/a ({self.layers} attention layer{'s' if self.layers != 1 else ''})"
        lo, hi = min(self.spans), max(self.spans)
        figure = str(lo) if lo == hi else f"{lo}-{hi} (mean {sum(self.spans) / len(self.spans):.1f})"
        return f"per decoder layer: {figure} instructions ({len(self.spans)} spans between consecutive {ATTEND})"


def layer_counts(graph: Graph) -> LayerCounts:
    calls = [i for i, instr in enumerate(graph.instructions) if instr.op == ATTEND]
    spans = tuple(b - a for a, b in zip(calls, calls[1:]))
    return LayerCounts(len(graph.instructions), len(calls), spans)
