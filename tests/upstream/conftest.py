"""Tiny checkpoints exported by upstream ExecuTorch's exporter, once per test session."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def upstream_pte(tmp_path_factory, tiny_checkpoint) -> Callable[[str, str], Path]:
    """``upstream_pte(family, dtype) -> Path``: exported on first use (dtype fp32/fp16/bf16)."""
    out = tmp_path_factory.mktemp("upstream_pte")

    def get(family: str, dtype: str) -> Path:
        path = out / f"{family}_{dtype}.pte"
        if not path.exists():
            spec = f"{family}:{dtype}:{tiny_checkpoint(family)}"
            done = subprocess.run(
                [sys.executable, "-m", "tests.upstream.export_upstream", str(out), spec],
                cwd=REPO, capture_output=True, text=True,
            )  # fmt: skip
            assert done.returncode == 0 and path.exists(), f"upstream's export failed:\n{done.stderr[-3000:]}"
        return path

    return get
