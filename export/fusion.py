"""Lowering-time fusion: exact subgraphs of the edge graph that lower to one IR op.

HF modeling code writes RMSNorm, rotary embeddings and gated MLPs out of elementwise ops,
so the edge graph holds them as chains. Each op is a dispatch and a pass over memory, so
one fused op per chain saves most of that work. The matchers (``fusion_norm``,
``fusion_rope``, ``fusion_glu``) accept a chain only when it computes exactly the fused
op's math (see ``fusion_match``).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.export import ExportedProgram
from torch.fx import Node

from .fusion_glu import match_glu
from .fusion_match import LowerFn, Matcher
from .fusion_norm import match_rms_norm
from .fusion_rope import match_rope
from .graph_builder import constant_source

_MATCHERS: tuple[Matcher, ...] = (match_rms_norm, match_rope, match_glu)


@dataclass(frozen=True)
class Fusions:
    """The fusions of one graph: how each root lowers, and the nodes not lowered on their own
    (every chain's inner nodes, and constant placeholders only they read, like an eps)."""

    roots: dict[Node, LowerFn]
    absorbed: frozenset[Node]


def find_fusions(ep: ExportedProgram) -> Fusions:
    """Every fusable chain of ``ep``'s graph (chains never overlap).

    Nodes are visited last to first, so the longest chain ending at a node claims it
    before a shorter chain inside it could (an RMSNorm's final cast before its multiply).
    """
    roots: dict[Node, LowerFn] = {}
    absorbed: set[Node] = set()
    for node in reversed(ep.graph.nodes):
        if node in absorbed:
            continue
        for match in _MATCHERS:
            fusion = match(ep, node)
            if fusion is not None and not fusion.absorbed & (absorbed | roots.keys()):
                roots[node] = fusion.lower
                absorbed |= fusion.absorbed
                break
    constants = [
        n for n in ep.graph.nodes
        if n.op == "placeholder" and n.users and set(n.users) <= absorbed and constant_source(ep, n) is not None
    ]  # fmt: skip
    return Fusions(roots, frozenset(absorbed.union(constants)))
