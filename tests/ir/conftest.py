"""Genuine .pte files built with ExecuTorch, whose MLXBackend delegate carries a payload
made by ``encode_payload``, shared by the pte, fuzz and CLI tests."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from mlx_pte.ir.payload import encode_payload
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
    """{"segment": ..., "inline": ...}: the delegate extracted to a segment, or inline."""
    tmp = tmp_path_factory.mktemp("pte")
    files = {}
    for name, extract in (("segment", True), ("inline", False)):
        s = sample()
        blob = encode_payload(s.graph, s.constants, s.manifest)
        path = write_pte(tmp / f"tiny_{name}.pte", blob, extract)
        files[name] = PteFile(path, path.read_bytes(), blob, s)
    return files
