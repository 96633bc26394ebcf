"""The MLX byte layer of every cache kind.

Importing this package registers backend ``"mlx"`` for every kind in ``CACHE_FACTORY``.
K/V are stored in the config's ``kv_dtype``; attention computes in fp32.
"""
from . import blas  # noqa: F401  (first: it must load the BLAS before mlx.core)

from mlx_pte.runtime.cache import CACHE_FACTORY

from .attention import attend
from .cells import MLXCellCache
from .masks import lower_right_mask
from .pool import STORAGE_DTYPES, Pool, PoolBoundsError
from .sequence import MLXBatchedSequenceCache, MLXSingleCache

BACKEND_ID = "mlx"

CACHE_FACTORY.register_backend(BACKEND_ID, MLXSingleCache, MLXCellCache, MLXBatchedSequenceCache)

__all__ = [
    "BACKEND_ID",
    "STORAGE_DTYPES",
    "MLXBatchedSequenceCache",
    "MLXCellCache",
    "MLXSingleCache",
    "Pool",
    "PoolBoundsError",
    "attend",
    "lower_right_mask",
]
