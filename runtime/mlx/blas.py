"""Load an optimized BLAS into the process before MLX initializes.

MLX's Linux CPU wheel resolves its ``sgemm`` symbols at load time; when a
fast BLAS is already loaded with ``RTLD_GLOBAL`` those symbols bind to it
instead of the slow reference BLAS, which makes fp32 matmul several times
faster. Import this module before ``mlx.core`` anywhere the project uses MLX.
On macOS MLX uses Accelerate, so this is a no-op there.

Resolution order: ``$MLX_PTE_BLAS`` (a path to a shared library), then the
system OpenBLAS. Loading is idempotent; a missing BLAS warns once.

A process that also uses torch must import torch *first*. ``libtorch_cpu`` exports
its own (MKL) ``sgemm_``, ``sgemv_``, ... and calls them through its PLT; Python loads
extensions with ``RTLD_NOW``, so those calls bind when torch is imported, to the first
definition in the global scope. With this BLAS already loaded ``RTLD_GLOBAL``, that is
OpenBLAS's (``LD_DEBUG=bindings`` shows ~100 BLAS/LAPACK symbols of libtorch_cpu bound
to libopenblas), and torch's CPU matmuls run OpenBLAS's pthread build under torch's
OpenMP threads: HF eager decoded 5.5 tok/s instead of 28.6 on a 2-core machine.
Imported first, torch binds its own and keeps them. ``mlx_pte.export`` warns when it
finds the wrong order.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import warnings
from pathlib import Path

ENV_VAR = "MLX_PTE_BLAS"

# Known OpenBLAS locations (Debian/Ubuntu multiarch, Fedora, generic).
_KNOWN_PATHS: tuple[str, ...] = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

_loaded_path: str | None = None
_attempted = False


def _candidates() -> list[str]:
    """Paths to try, in priority order."""
    found: list[str] = []
    override = os.environ.get(ENV_VAR)
    if override:
        found.append(override)
    by_name = ctypes.util.find_library("openblas")
    if by_name:
        found.append(by_name)
    found.extend(p for p in _KNOWN_PATHS if Path(p).exists())
    return found


def load() -> str | None:
    """Load the BLAS once with ``RTLD_GLOBAL``.

    Returns:
        The path of the loaded library, or None when none was found (or on
        macOS, where Accelerate is used).
    """
    global _loaded_path, _attempted
    if _attempted:
        return _loaded_path
    _attempted = True
    if sys.platform == "darwin":
        return None
    for path in _candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _loaded_path = path
        return path
    warnings.warn(
        "mlx-pte: no optimized BLAS found, MLX matmul will be slow; "
        f"install OpenBLAS (apt install libopenblas0-pthread) or set {ENV_VAR}=/path/to/libblas.so",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


def loaded_path() -> str | None:
    """The BLAS library loaded by :func:`load`, if any."""
    return _loaded_path


load()
