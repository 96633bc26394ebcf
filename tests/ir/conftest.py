"""Genuine .pte files built with ExecuTorch, whose MLX delegate carries a payload made by
``encode_payload``, shared by the pte, fuzz and CLI tests."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from mlx_pte.ir.payload import encode_payload
from mlx_pte.ir.pte import BACKEND_ID, LEGACY_BACKEND_ID
from tests.fixtures.crafted_pte import write_pte

from .sample import Sample, sample


@dataclass
class PteFile:
    path: Path
    data: bytes
    payload: bytes  # what the backend's preprocess returned
    sample: Sample


@pytest.fixture(scope="session")
def pte_files(tmp_path_factory) -> dict[str, PteFile]:
    """{"segment": ..., "inline": ...}: the delegate extracted to a segment, or inline;
    "legacy": a segment under the delegate id mlx-pte wrote before its rename."""
    tmp = tmp_path_factory.mktemp("pte")
    files = {}
    for name, extract, delegate_id in (
        ("segment", True, BACKEND_ID), ("inline", False, BACKEND_ID), ("legacy", True, LEGACY_BACKEND_ID)
    ):
        s = sample()
        blob = encode_payload(s.graph, s.constants, s.manifest)
        path = write_pte(tmp / f"tiny_{name}.pte", blob, extract, delegate_id)
        files[name] = PteFile(path, path.read_bytes(), blob, s)
    return files
