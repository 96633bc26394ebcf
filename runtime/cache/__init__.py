"""Backend-neutral KV-cache planning: integers only, no tensors.

It decides where each step's K/V go, what each query may read, and whether a request is
admitted. Byte layers (``runtime.mlx``, ``runtime.reference``) subclass the kinds here
and read the declared step's plan.
"""
from .base import CacheBase, IdPool
from .batched import BatchedSequenceCache
from .cells import CellCache, CellStepPlan
from .config import KV_DTYPES, CacheConfig, CacheGeometry, LayerGeometry, LayerPolicy, PolicyKind
from .errors import (
    AttendError,
    CacheError,
    CacheKindNotFound,
    CacheRefused,
    CacheRegistrationError,
    InvalidCacheConfig,
    InvalidStep,
    StepStateError,
)
from .faces import CacheControl, StepControl
from .plans import FlatLayout, MaskKind, PolicyTable, RingLayout, Run, RunPlan
from .registry import (
    CACHE_FACTORY,
    KIND_BATCHED_CELL,
    KIND_BATCHED_SEQUENCE,
    KIND_SINGLE,
    KINDS,
    CacheFactory,
)
from .sequence import CacheUsage, SequenceAdmission, SequenceHistory, SequenceStepPlan, SingleCache, SpanPlan
from .step import ALLOWED, Span, Step, Verdict

NEUTRAL_BACKEND = "neutral"

# The bookkeeping alone, for planning without bytes (admission simulation, tests).
CACHE_FACTORY.register_backend(NEUTRAL_BACKEND, SingleCache, CellCache, BatchedSequenceCache)

__all__ = [name for name in dir() if not name.startswith("_")]
