"""The PyTorch eager byte layer of every cache kind: the oracle the MLX layer must match.

Importing this package registers backend ``"reference"`` for every kind in
``CACHE_FACTORY``. Attention runs in fp32 with explicit masks; K/V are stored in the
config's ``kv_dtype``.
"""
from mlx_pte.runtime.cache import CACHE_FACTORY

from .attention import STORAGE_DTYPES, attend, lower_right_mask
from .cells import ReferenceCellCache
from .sequence import ReferenceBatchedSequenceCache, ReferenceSingleCache

BACKEND_ID = "reference"

CACHE_FACTORY.register_backend(
    BACKEND_ID, ReferenceSingleCache, ReferenceCellCache, ReferenceBatchedSequenceCache
)

__all__ = [
    "BACKEND_ID",
    "STORAGE_DTYPES",
    "ReferenceBatchedSequenceCache",
    "ReferenceCellCache",
    "ReferenceSingleCache",
    "attend",
    "lower_right_mask",
]
