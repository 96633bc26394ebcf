"""The BLAS loader: override, system library, one warning when none is found."""
from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from mlx_pte.runtime.mlx import blas

OPENBLAS_DIR = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread")


def loaded_in_fresh_process(env: dict) -> str:
    """``loaded_path()`` reported by a fresh interpreter importing the loader."""
    code = "from mlx_pte.runtime.mlx import blas; print(blas.loaded_path())"
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.skipif(sys.platform != "linux" or not OPENBLAS_DIR.exists(), reason="needs Debian's OpenBLAS")
def test_the_override_wins_over_the_system_library():
    target = next(OPENBLAS_DIR.glob("libopenblasp-*.so"))
    env = {"PATH": "/usr/bin:/bin", "MLX_PTE_BLAS": str(target)}
    assert loaded_in_fresh_process(env) == str(target)


@pytest.mark.skipif(sys.platform != "linux" or not OPENBLAS_DIR.exists(), reason="needs Debian's OpenBLAS")
def test_a_system_openblas_is_found_without_configuration():
    assert "openblas" in loaded_in_fresh_process({"PATH": "/usr/bin:/bin"})


def test_no_blas_warns_once_with_what_to_do(monkeypatch):
    monkeypatch.setattr(blas, "_attempted", False)
    monkeypatch.setattr(blas, "_loaded_path", None)
    monkeypatch.setattr(blas.sys, "platform", "linux")
    monkeypatch.setattr(blas, "_candidates", lambda: ["/nonexistent/libopenblas.so"])
    with pytest.warns(RuntimeWarning, match="MLX_PTE_BLAS"):
        assert blas.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert blas.load() is None


def test_macos_uses_accelerate_and_loads_nothing(monkeypatch):
    monkeypatch.setattr(blas, "_attempted", False)
    monkeypatch.setattr(blas, "_loaded_path", None)
    monkeypatch.setattr(blas.sys, "platform", "darwin")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert blas.load() is None
