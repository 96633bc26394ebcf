"""Builders shared by the MLX byte-layer tests."""
from __future__ import annotations

from typing import Sequence

import numpy as np

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

import mlx_pte.runtime.mlx  # noqa: F401  (registers backend "mlx")
from mlx_pte.runtime.cache import CACHE_FACTORY, CacheConfig, CacheGeometry, LayerPolicy

from .oracle import Driver, HistoryOracle

Q_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def make_driver(
    kind: str,
    windows: Sequence[int],
    capacity: int = 64,
    *,
    max_write: int | None = None,
    initial_capacity: int = 512,
    kv_dtype: str = "float32",
    q_heads: int = Q_HEADS,
    kv_heads: int = KV_HEADS,
    head_dim: int = HEAD_DIM,
    v_head_dim: int | None = None,
    seed: int = 0,
    **driver_options,
) -> Driver:
    """An MLX cache of ``kind`` (one layer per window; 0 = flat) and its oracle driver;
    V's head dim is K's unless given."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    policies = [LayerPolicy.from_window(w) for w in windows]
    geometry = CacheGeometry.uniform(policies, kv_heads, head_dim, v_head_dim)
    config = CacheConfig(
        capacity=capacity, max_write=max_write, initial_capacity=initial_capacity, kv_dtype=kv_dtype
    )
    cache = CACHE_FACTORY.build("mlx", kind, geometry, config)
    return Driver(
        cache,
        HistoryOracle(list(windows), kv_dtype),
        q_heads,
        kv_heads,
        head_dim,
        v_head_dim,
        np.random.default_rng(seed),
        **driver_options,
    )


def bits(mask: mx.array) -> list[str]:
    """The rows of a [1, 1, T, S] (or [T, S]) bool mask as strings of 0/1."""
    rows = np.array(mask).reshape(-1, mask.shape[-1])
    return ["".join("1" if b else "0" for b in row) for row in rows]
