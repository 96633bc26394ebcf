"""The MLX side: load a .pte and run it (the prepared plan, op handlers, sessions, capture).

Names are resolved lazily so importing a light submodule does not load MLX.
"""
from mlx_pte.ir.lazy_exports import lazy_exports

_EXPORTS = {
    "load": ".program",
    "Program": ".program",
    "Session": ".session",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
