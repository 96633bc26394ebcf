"""The torch side: the custom op, the HF adapter, lowering to the IR, the ExecuTorch backend."""
from importlib import import_module
from typing import Any

_EXPORTS = {
    "export_hf": ".hf_export",
    "export_module": ".program",
    "export_program": ".program",
    "bind_cache": ".custom_ops",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name], __name__), name)
