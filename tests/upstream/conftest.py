"""Tiny checkpoints exported by upstream ExecuTorch's exporter, once per test session."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
# Exported together on first use (one exporter start-up); the fast tests use only these.
FAST_EXPORTS = (("llama", "fp32"), ("gemma3", "fp32"), ("gemma3", "bf16"))


@pytest.fixture(scope="session")
def upstream_pte(tmp_path_factory, tiny_checkpoint) -> Callable[[str, str], Path]:
    """``upstream_pte(family, dtype) -> Path``: exported on first use (dtype fp32/fp16/bf16)."""
    out = tmp_path_factory.mktemp("upstream_pte")

    def path_of(family: str, dtype: str) -> Path:
        return out / f"{family}_{dtype}.pte"

    def get(family: str, dtype: str) -> Path:
        if not path_of(family, dtype).exists():
            wanted = FAST_EXPORTS if (family, dtype) in FAST_EXPORTS else ((family, dtype),)
            specs = [f"{f}:{d}:{tiny_checkpoint(f)}" for f, d in wanted if not path_of(f, d).exists()]
            done = subprocess.run(
                [sys.executable, "-m", "tests.upstream.export_upstream", str(out), *specs],
                cwd=REPO, capture_output=True, text=True,
            )  # fmt: skip
            assert done.returncode == 0, f"upstream's export failed:\n{done.stderr[-3000:]}"
        return path_of(family, dtype)

    return get
