"""mlx-pte: export Hugging Face causal LMs to ExecuTorch .pte files and run them on MLX.

The public API, resolved on first use so that ``import mlx_pte`` loads neither MLX nor torch:
``export_hf`` (torch side), ``load`` and ``Session`` (run a program), ``generate`` and
``Engine`` (serve requests), with their ``SamplingParams``, ``Request`` and ``GenerationResult``.
"""
from mlx_pte.ir.lazy_exports import lazy_exports

_EXPORTS = {
    "export_hf": "mlx_pte.export.hf_export",
    "load": "mlx_pte.interpreter.program",
    "Program": "mlx_pte.interpreter.program",
    "Session": "mlx_pte.interpreter.session",
    "generate": "mlx_pte.serving.generation",
    "GenerationResult": "mlx_pte.serving.generation",
    "SamplingParams": "mlx_pte.serving.sampling.params",
    "Engine": "mlx_pte.serving.engine",
    "Request": "mlx_pte.serving.engine",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
