"""MLX as the project loads it: ``from mlx_pte.runtime.mlx.bootstrap import mx``.

The rule, stated once: an optimized BLAS is loaded into the process before ``mlx.core``
initializes (``blas`` says why: MLX's Linux CPU wheel binds its ``sgemm`` symbols when it
loads), and a process that also uses torch imports torch before either. Modules take
``mx`` from here rather than importing ``mlx.core`` themselves, so none can get the order
wrong.
"""
from . import blas  # noqa: F401  (first: the BLAS before mlx.core)

import mlx.core as mx  # noqa: E402

__all__ = ["mx"]
