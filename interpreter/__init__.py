"""The MLX side: load a .pte and run it (sessions, generation, batching).

Names are resolved lazily so importing a light submodule (e.g. the server's request
parsing) does not load MLX.
"""
from mlx_pte import lazy_exports

_EXPORTS = {
    "load": ".program",
    "Program": ".program",
    "Session": ".session",
    "generate": ".generation",
    "GenerationResult": ".generation",
    "SamplingParams": ".sampling",
    "Engine": ".engine",
    "Request": ".engine",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
