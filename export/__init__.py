"""The torch side: the custom op, the HF adapter, lowering to the IR, the ExecuTorch backend."""
import sys
import warnings

from mlx_pte.ir.lazy_exports import lazy_exports

# See mlx_pte/runtime/mlx/blas.py: torch imported after the OpenBLAS loader calls OpenBLAS.
_blas = sys.modules.get("mlx_pte.runtime.mlx.blas")
if "torch" not in sys.modules and _blas is not None and _blas.loaded_path():
    warnings.warn(
        "mlx-pte: OpenBLAS was loaded before torch, so torch's matmuls will run on it (several "
        "times slower); import torch (or mlx_pte.export) before mlx_pte.interpreter / runtime.mlx",
        RuntimeWarning,
        stacklevel=2,
    )

_EXPORTS = {
    "export_hf": ".hf_export",
    "export_module": ".program",
    "export_program": ".program",
    "bind_cache": ".custom_ops",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
