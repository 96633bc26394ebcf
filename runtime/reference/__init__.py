"""The PyTorch eager byte layer of every cache kind: the oracle the MLX layer must match.

Importing this package registers backend ``"reference"`` for every kind in
``CACHE_FACTORY``. Attention runs in fp32 with explicit masks; K/V are stored in the
config's ``kv_dtype``.
"""
from mlx_pte.runtime.cache import (
    CACHE_FACTORY,
    KIND_BATCHED_CELL,
    KIND_BATCHED_SEQUENCE,
    KIND_SINGLE,
)

from .attention import STORAGE_DTYPES, attend, lower_right_mask
from .cells import ReferenceCellCache
from .sequence import ReferenceBatchedSequenceCache, ReferenceSingleCache

BACKEND_ID = "reference"

for _kind, _cls in (
    (KIND_SINGLE, ReferenceSingleCache),
    (KIND_BATCHED_CELL, ReferenceCellCache),
    (KIND_BATCHED_SEQUENCE, ReferenceBatchedSequenceCache),
):
    CACHE_FACTORY.register(BACKEND_ID, _kind, _cls)

__all__ = [
    "BACKEND_ID",
    "STORAGE_DTYPES",
    "ReferenceBatchedSequenceCache",
    "ReferenceCellCache",
    "ReferenceSingleCache",
    "attend",
    "lower_right_mask",
]
