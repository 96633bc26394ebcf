"""Tiny checkpoints exported by upstream ExecuTorch's exporter, once per test session."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
# Exported together on first use (one exporter start-up); the fast tests use only these (a
# full-precision and a 4-bit llama, gemma3's sliding window); every other variant is slow.
FAST_EXPORTS = (("llama", "fp32"), ("gemma3", "fp32"), ("llama", "fp32-4w"))


@pytest.fixture(scope="session")
def upstream_pte(tmp_path_factory, tiny_checkpoint) -> Callable[[str, str], Path]:
    """``upstream_pte(family, variant) -> Path``: exported on first use (a variant of
    ``export_upstream``: fp32/fp16/bf16, optionally quantized, e.g. bf16-4w)."""
    out = tmp_path_factory.mktemp("upstream_pte")

    def path_of(family: str, variant: str) -> Path:
        return out / f"{family}_{variant}.pte"

    def get(family: str, variant: str) -> Path:
        if not path_of(family, variant).exists():
            wanted = FAST_EXPORTS if (family, variant) in FAST_EXPORTS else ((family, variant),)
            specs = [f"{f}:{d}:{tiny_checkpoint(f)}" for f, d in wanted if not path_of(f, d).exists()]
            done = subprocess.run(
                [sys.executable, "-m", "tests.upstream.export_upstream", str(out), *specs],
                cwd=REPO, capture_output=True, text=True,
            )  # fmt: skip
            assert done.returncode == 0, f"upstream's export failed:\n{done.stderr[-3000:]}"
        return path_of(family, variant)

    return get
