"""The ExecuTorch backend: ``preprocess`` turns the delegated edge program into the MLX
payload (IR graph + manifest) that the interpreter runs, its weights streamed into the
program's named data (``weight_writer``).

Two compile specs (JSON) reach ``preprocess``: the manifest to store, and the program's
``Signature`` (input/output order and dynamic ranges, which the delegated program lacks).
The manifest also carries the lowering's options: ``quantization``, and
``extra["projections"] = "separate"`` when projections are not fused (``SEPARATE``).
"""
from __future__ import annotations

import json
from typing import Any, Mapping

import torch
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.lowered_backend_module import LoweredBackendModule
from torch.export import ExportedProgram

from executorch.exir._serialize._named_data_store import NamedDataStore

from mlx_pte.ir.payload import WEIGHTS_ALIGNMENT, WEIGHTS_KEY, encode_external_payload
from mlx_pte.ir.pte import BACKEND_ID
from mlx_pte.ir.quantization import QuantSpec

from .errors import ExportError
from .lowering import Signature, lower_program
from .weight_writer import active_sink, write_weights

MANIFEST_SPEC = "manifest"
SIGNATURE_SPEC = "signature"
# The manifest's extra["projections"] of an export whose linears are not fused.
SEPARATE = "separate"


def compile_specs(manifest: Mapping[str, Any], signature: Signature) -> list[CompileSpec]:
    try:
        manifest_json = json.dumps(manifest, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ExportError(f"the manifest must be JSON-serializable: {exc}") from None
    return [
        CompileSpec(MANIFEST_SPEC, manifest_json.encode()),
        CompileSpec(SIGNATURE_SPEC, signature.to_json()),
    ]


def drop_preprocess_specs(module: torch.nn.Module) -> None:
    """Remove our compile specs from the lowered MLX modules under ``module``.

    They only feed ``preprocess``, whose payload already holds the manifest; ExecuTorch
    would otherwise also serialize them, storing a multi-MB tokenizer twice.
    """
    for sub in module.modules():
        if isinstance(sub, LoweredBackendModule) and sub.backend_id == BACKEND_ID:
            sub._compile_specs = [s for s in sub.compile_specs if s.key not in (MANIFEST_SPEC, SIGNATURE_SPEC)]


def _spec(specs: list[CompileSpec], key: str) -> bytes:
    for spec in specs:
        if spec.key == key:
            return bytes(spec.value)
    raise ExportError(f"{BACKEND_ID} needs the {key!r} compile spec: lower with MLXPtePartitioner")


class MLXPteBackend(BackendDetails):
    """mlx-pte's backend; named apart from upstream ExecuTorch's ``MLXBackend``, since
    ExecuTorch resolves a delegate's backend by class name."""

    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:
        manifest = json.loads(_spec(compile_specs, MANIFEST_SPEC))
        # The manifest records the quantization type the lowering applies.
        quantization = manifest.get("quantization")
        graph, constants = lower_program(
            edge_program,
            Signature.from_json(_spec(compile_specs, SIGNATURE_SPEC)),
            None if quantization is None else QuantSpec.from_dict(quantization),
            fused_projections=manifest.get("extra", {}).get("projections") != SEPARATE,
        )
        sink = active_sink()
        placed, size, weights = write_weights(graph, constants, sink)
        store = NamedDataStore()
        store.add_named_data(WEIGHTS_KEY, weights, alignment=WEIGHTS_ALIGNMENT)
        return PreprocessResult(
            encode_external_payload(graph, placed, size, manifest),
            data_store_output=store.get_named_data_store_output(),
        )


assert MLXPteBackend.__name__ == BACKEND_ID  # executorch finds backends by class name
