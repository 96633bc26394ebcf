"""Genuine .pte files built with ExecuTorch, whose MLX delegate carries a payload made by
``encode_payload``, shared by the pte, fuzz and CLI tests."""
from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlx_pte.ir.payload import encode_payload
from mlx_pte.ir.pte import BACKEND_ID, LEGACY_BACKEND_ID

from .sample import Sample, sample


@dataclass
class PteFile:
    path: Path
    data: bytes
    payload: bytes  # what the backend's preprocess returned
    sample: Sample


def _export(tmp: Path, extract_segments: bool, delegate_id: str) -> tuple[Path, list[bytes]]:
    import torch
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
    from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult

    made: list[bytes] = []
    s = sample()

    # ExecuTorch looks backends up by class name, and the real backends (ours and
    # upstream's) may be imported: this one has a name of its own, as long as the wanted
    # delegate id, which replaces it in the written file (a FlatBuffer string of the same
    # length). It is dropped after the export.
    placeholder = "X" * (len(delegate_id) - 4) + "Fake"

    def preprocess(edge_program, compile_specs) -> PreprocessResult:
        blob = encode_payload(s.graph, s.constants, s.manifest)
        made.append(blob)
        return PreprocessResult(processed_bytes=blob)

    FakeBackend = type(placeholder, (BackendDetails,), {"preprocess": staticmethod(preprocess)})

    class WholeGraph(Partitioner):
        def __init__(self):
            super().__init__()
            self.delegation_spec = DelegationSpec(placeholder, [])

        def partition(self, ep) -> PartitionResult:
            for node in ep.graph_module.graph.nodes:
                if node.op == "call_function":
                    node.meta["delegation_tag"] = "mlx"
            return PartitionResult(tagged_exported_program=ep, partition_tags={"mlx": self.delegation_spec})

    class Tiny(torch.nn.Module):
        def forward(self, x):
            return x * 2.0 + 1.0

    ep = torch.export.export(Tiny(), (torch.ones(2, 3),))
    edge = to_edge_transform_and_lower(ep, partitioner=[WholeGraph()])
    program = edge.to_executorch(ExecutorchBackendConfig(extract_delegate_segments=extract_segments))
    data = program.buffer
    assert data.count(placeholder.encode()) == 1, "the placeholder id is not unique in the file"
    path = tmp / f"tiny_{'segment' if extract_segments else 'inline'}_{delegate_id}.pte"
    path.write_bytes(data.replace(placeholder.encode(), delegate_id.encode()))
    del FakeBackend, edge, program
    gc.collect()
    return path, made


@pytest.fixture(scope="session")
def pte_files(tmp_path_factory) -> dict[str, PteFile]:
    """{"segment": ..., "inline": ...}: the delegate extracted to a segment, or inline;
    "legacy": a segment under the delegate id mlx-pte wrote before its rename."""
    tmp = tmp_path_factory.mktemp("pte")
    files = {}
    for name, extract, delegate_id in (
        ("segment", True, BACKEND_ID), ("inline", False, BACKEND_ID), ("legacy", True, LEGACY_BACKEND_ID)
    ):
        path, made = _export(tmp, extract, delegate_id)
        assert len(made) == 1, "the test backend's preprocess did not run exactly once"
        files[name] = PteFile(path, path.read_bytes(), made[0], sample())
    return files
