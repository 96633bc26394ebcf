"""The torch side: the custom op, the HF adapter, lowering to the IR, the ExecuTorch backend."""
from mlx_pte import lazy_exports

_EXPORTS = {
    "export_hf": ".hf_export",
    "export_module": ".program",
    "export_program": ".program",
    "bind_cache": ".custom_ops",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
