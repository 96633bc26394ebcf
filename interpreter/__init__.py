"""The MLX side: load a .pte and run it (sessions, generation, batching).

Names are resolved lazily so importing a light submodule (e.g. the server's request
parsing) does not load MLX.
"""
from importlib import import_module
from typing import Any

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


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name], __name__), name)
