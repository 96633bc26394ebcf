"""Serving requests on a loaded program: generation, device sampling, streaming
detokenization, stop strings, the continuous-batching engine and the OpenAI HTTP app.

Names are resolved lazily so the command line and request parsing do not load MLX.
"""
from mlx_pte.ir.lazy_exports import lazy_exports

_EXPORTS = {
    "generate": ".generation",
    "GenerationResult": ".generation",
    "SamplingParams": ".sampling.params",
    "Engine": ".engine",
    "Request": ".engine",
    "open_engine": ".engine",
    "Grammar": ".sampling.grammar",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
