"""The partitioner: delegate the WHOLE edge graph to ``MLXPteBackend`` or fail.

A graph with any op the lowering table does not accept is an export error listing every
such op with its count; a partial delegation (CPU islands between MLX ones) is never made.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Mapping, Optional

import torch
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from executorch.exir.backend.utils import tag_constant_data
from torch.export import ExportedProgram

from .backend import BACKEND_ID, compile_specs
from .errors import ExportError, UnsupportedOpsError
from .lowering import DimRange, Signature, unsupported_reason

aten = torch.ops.aten

# Ops the lowering handles natively that to_edge would otherwise decompose.
PRESERVED_OPS = (
    aten.linear.default,
    aten.rms_norm.default,
    aten.layer_norm.default,
    aten.embedding.default,
    aten.silu.default,
)

TAG = "mlx_0"


class MLXPtePartitioner(Partitioner):
    """Tags every compute node for ``MLXPteBackend``.

    Args:
        manifest: JSON-serializable metadata handed to ``preprocess`` as a compile spec.
        dim_ranges: the user's dynamic-dim ranges (``lowering.dim_ranges`` of the
            program before ``to_edge``), recorded on the payload's slot shapes.
    """

    def __init__(
        self,
        manifest: Optional[Mapping[str, Any]] = None,
        dim_ranges: Optional[Mapping[str, DimRange]] = None,
    ) -> None:
        super().__init__()
        self.manifest = dict(manifest or {})
        self.dim_ranges = dict(dim_ranges or {})

    def ops_to_not_decompose(
        self, ep: ExportedProgram
    ) -> tuple[list[torch._ops.OpOverload], Optional[Callable[[torch.fx.Node], bool]]]:
        return list(PRESERVED_OPS), None

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        nodes = [n for n in exported_program.graph_module.graph.nodes if n.op == "call_function"]
        unsupported = Counter(r for r in map(unsupported_reason, nodes) if r is not None)
        if unsupported:
            raise UnsupportedOpsError(unsupported)
        if not nodes:
            raise ExportError("the program computes nothing (it only returns its inputs); nothing to export")
        sig = exported_program.graph_signature
        if sig.buffers_to_mutate or sig.user_inputs_to_mutate:
            raise ExportError("forward() mutates buffers or inputs; the MLX backend runs functional programs only")
        for node in nodes:
            node.meta["delegation_tag"] = TAG
        tag_constant_data(exported_program)
        signature = Signature(tuple(sig.user_inputs), tuple(sig.user_outputs), self.dim_ranges)
        spec = DelegationSpec(BACKEND_ID, compile_specs(self.manifest, signature))
        return PartitionResult(exported_program, {TAG: spec})
