"""The BLAS loader: override, system library, one warning when none is found."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

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


REPO = Path(__file__).resolve().parents[3]


def torch_sgemm_library(code: str, tmp_path: Path, argv: Optional[Sequence[str]] = None) -> str:
    """Where ``libtorch_cpu``'s ``sgemm_`` binds in a fresh process running ``code`` (or the
    command line ``argv``), from glibc's LD_DEBUG trace of symbol bindings."""
    trace = tmp_path / "bindings"
    env = {"PATH": "/usr/bin:/bin", "LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(trace), "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, *(argv or ("-c", code))], env=env, cwd=REPO, capture_output=True, text=True)
    for part in tmp_path.glob("bindings.*"):
        for line in part.read_text(errors="replace").splitlines():
            if "libtorch_cpu.so" in line.split(" to ")[0] and line.endswith("symbol `sgemm_'"):
                return line.split(" to ")[1].split(" ")[0]
    raise AssertionError(f"no binding of libtorch_cpu's sgemm_ traced for {code!r}")


needs_openblas = pytest.mark.skipif(
    sys.platform != "linux" or blas.loaded_path() is None, reason="needs glibc and a system OpenBLAS"
)


@needs_openblas
def test_torch_imported_after_the_loader_calls_openblas(tmp_path):
    # The failure mode itself, so the checks below can fail.
    library = torch_sgemm_library("import mlx_pte.runtime.mlx.blas, torch", tmp_path)
    assert "openblas" in library


@needs_openblas
def test_the_test_suite_imports_torch_before_the_loader(tmp_path):
    code = "import tests.conftest, mlx_pte.interpreter.session, torch; torch.ones(4, 4) @ torch.ones(4, 4)"
    assert torch_sgemm_library(code, tmp_path).endswith("libtorch_cpu.so")


@needs_openblas
@pytest.mark.slow
def test_the_decode_bench_imports_torch_before_the_loader(tmp_path):
    # Run as the bench runs its jobs (a script, so bench/ is on sys.path for its sibling
    # modules): the export job, the one that uses torch, imports everything, then fails on
    # the missing checkpoint.
    job = json.dumps({"kind": "export", "model_dir": "/nonexistent", "out": str(tmp_path / "x.pte"),
                      "bits": None, "group_size": 64})
    argv = ["bench/decode.py", "--engine-job", job]
    assert torch_sgemm_library("", tmp_path, argv).endswith("libtorch_cpu.so")


def test_the_export_package_warns_when_torch_comes_after_the_loader():
    code = "import mlx_pte.runtime.mlx.blas, mlx_pte.export"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    if blas.loaded_path() is not None:
        assert "import torch (or mlx_pte.export) before" in out.stderr
    quiet = subprocess.run([sys.executable, "-c", "import torch, mlx_pte.runtime.mlx.blas, mlx_pte.export"],
                           cwd=REPO, capture_output=True, text=True, check=True)
    assert "OpenBLAS was loaded before torch" not in quiet.stderr
