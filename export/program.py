"""Export a torch module, or an already exported program, to an ExecuTorch ``.pte`` file
whose whole graph is delegated to the MLX backend.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
from torch.export import ExportedProgram

from mlx_pte.ir.quantization import QuantSpec

from .backend import drop_preprocess_specs
from .lowering import dim_ranges
from .partitioner import MLXPartitioner

PathLike = Union[str, "os.PathLike[str]"]


def export_program(
    ep: ExportedProgram,
    out: PathLike,
    manifest: Optional[Mapping[str, Any]] = None,
    quantization: Optional[QuantSpec] = None,
) -> Path:
    """Lower ``ep`` to the MLX backend and write the ``.pte`` to ``out``.

    The file is written atomically: on any failure nothing is left at ``out``.

    Args:
        ep: an ATen-dialect program from ``torch.export.export``.
        out: the ``.pte`` path to write.
        manifest: JSON-serializable metadata stored in the delegate payload
            (see ``ir.manifest.Manifest``); ``{}`` when omitted.
        quantization: quantize linear and embedding weights to this type (see
            ``export.quantize``; recorded as the manifest's ``quantization``).

    Returns:
        The path written.

    Raises:
        UnsupportedOpsError: the graph uses ops the backend cannot lower (all listed).
    """
    manifest = dict(manifest or {})
    if quantization is not None:
        manifest["quantization"] = quantization.to_dict()
    edge = to_edge_transform_and_lower(
        ep,
        partitioner=[MLXPartitioner(manifest, dim_ranges(ep))],
        # Non-core ops (linear, rms_norm, the custom op) must survive to the partitioner.
        compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True),
    )
    drop_preprocess_specs(edge.exported_program().graph_module)
    buffer = edge.to_executorch().buffer
    return _write_atomically(Path(out), buffer)


def export_module(
    module: torch.nn.Module,
    example_inputs: Sequence[Any],
    out: PathLike,
    dynamic_shapes: Optional[Any] = None,
    manifest: Optional[Mapping[str, Any]] = None,
    quantization: Optional[QuantSpec] = None,
) -> Path:
    """``torch.export`` ``module`` (non-strict) on ``example_inputs``, then ``export_program``.

    Args:
        module: the module to export (put it in eval mode first).
        example_inputs: positional inputs for tracing.
        out: the ``.pte`` path to write.
        dynamic_shapes: as ``torch.export.export`` takes them.
        manifest, quantization: see ``export_program``.

    Returns:
        The path written.
    """
    ep = torch.export.export(module, tuple(example_inputs), dynamic_shapes=dynamic_shapes, strict=False)
    return export_program(ep, out, manifest, quantization)


def _write_atomically(out: Path, data: bytes) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise
    return out
