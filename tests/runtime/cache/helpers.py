"""Shared test helpers: geometries, whole-state snapshots, mask rendering, step shortcuts."""
from __future__ import annotations

from enum import Enum
from typing import Any, Optional, Sequence

import numpy as np

from mlx_pte.runtime.cache import (
    CacheConfig,
    CacheGeometry,
    LayerPolicy,
    Step,
)

FLAT = LayerPolicy.flat()


def ring(window: int) -> LayerPolicy:
    return LayerPolicy.ring(window)


def geometry(*policies: LayerPolicy, heads: int = 2, dim: int = 8) -> CacheGeometry:
    """One layer per policy (two flat layers when none is given)."""
    return CacheGeometry.uniform(policies or (FLAT, FLAT), heads, dim)


def build(cls: type, capacity: int, *policies: LayerPolicy, max_write: Optional[int] = None,
          max_seqs: Optional[int] = None) -> Any:
    return cls(geometry(*policies), CacheConfig(capacity, max_write=max_write, max_seqs=max_seqs))


def run(cache: Any, seq_id: int, position: int, count: int) -> None:
    """Declare and finish ``count`` consecutive tokens of one sequence."""
    cache.declare_step(Step.run(position, count, seq_id))
    cache.finish_step()


def step(seq_ids: Sequence[int], positions: Sequence[int]) -> Step:
    return Step(tuple(seq_ids), tuple(positions))


def mask_rows(mask: np.ndarray) -> list[str]:
    """A bool mask rendered as rows of ``1`` (attend) and ``.``."""
    return ["".join("1" if b else "." for b in row) for row in mask]


def freeze(x: Any) -> Any:
    """A deep, comparable copy of ``x``: containers, arrays and plain objects by value."""
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, (Enum, str, bytes, int, float, type(None))):
        return x
    if isinstance(x, dict):
        return ("dict", tuple((freeze(k), freeze(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(freeze(i) for i in x))
    if isinstance(x, (set, frozenset)):
        return ("set", frozenset(freeze(i) for i in x))
    attrs = dict(getattr(x, "__dict__", {}))
    for cls in type(x).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(x, name):
                attrs[name] = getattr(x, name)
    return (type(x).__name__, freeze(attrs))


def snapshot(cache: Any) -> Any:
    """Everything a cache (and its shadow storage) holds, except the declared plan."""
    return freeze({k: v for k, v in vars(cache).items() if k != "_plan"})
