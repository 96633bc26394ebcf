"""The MLX byte layer of every cache kind.

Importing this package registers backend ``"mlx"`` for every kind in ``CACHE_FACTORY``.
K/V are stored in the config's ``kv_dtype``; attention computes in fp32.
"""
from . import blas  # noqa: F401  (first: it must load the BLAS before mlx.core)

from mlx_pte.runtime.cache import (
    CACHE_FACTORY,
    KIND_BATCHED_CELL,
    KIND_BATCHED_SEQUENCE,
    KIND_SINGLE,
)

from .attention import attend
from .cells import MLXCellCache
from .masks import lower_right_mask
from .pool import STORAGE_DTYPES, Pool, PoolBoundsError
from .sequence import MLXBatchedSequenceCache, MLXSingleCache

BACKEND_ID = "mlx"

for _kind, _cls in (
    (KIND_SINGLE, MLXSingleCache),
    (KIND_BATCHED_CELL, MLXCellCache),
    (KIND_BATCHED_SEQUENCE, MLXBatchedSequenceCache),
):
    CACHE_FACTORY.register(BACKEND_ID, _kind, _cls)

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
