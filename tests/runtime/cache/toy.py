"""A two-layer scalar attention model (flat, then ring(4)) run through a shadow cache, and
its cacheless brute-force oracle.

Every token is a scalar; each layer projects it to scalar q, k, v and attends with a
softmax. Layer 0 sees every earlier position, layer 1 the last ``WINDOW``.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from mlx_pte.runtime.cache import BatchedSequenceCache, CacheConfig, Step

from .helpers import FLAT, geometry, ring
from .shadow import ShadowBatched

WINDOW = 4
GEOMETRY = geometry(FLAT, ring(WINDOW), heads=1, dim=1)
EMBED = np.random.default_rng(0).normal(size=64)


def toy_cache(max_write: int, capacity: int = 128) -> ShadowBatched:
    return ShadowBatched(GEOMETRY, CacheConfig(capacity, max_write=max_write))


def _qkv(layer: int, x: float, position: int) -> tuple[float, float, float]:
    if layer == 0:
        return 0.9 * x + 0.3, 1.1 * x + 0.2 * math.sin(position), 0.7 * x + 0.5
    return 0.8 * x, 1.2 * x - 0.1, 0.6 * x - 0.2


def _attend(q: float, keys: Sequence[tuple[float, float]]) -> float:
    scores = np.array([q * k for k, _ in keys])
    p = np.exp(scores - scores.max())
    return float((p / p.sum()) @ np.array([v for _, v in keys]))


def oracle(tokens: Sequence[int]) -> list[float]:
    """Each position's output, recomputed from the whole token list without a cache."""
    x = [float(EMBED[t]) for t in tokens]
    h = []
    for layer in (0, 1):
        kv = [_qkv(layer, xi, p)[1:] for p, xi in enumerate(x)]
        out = []
        for i, xi in enumerate(x):
            lo = max(0, i - WINDOW + 1) if layer == 1 else 0
            out.append(xi + _attend(_qkv(layer, xi, i)[0], kv[lo : i + 1]))
        h, x = out, out
    return h


def forward(cache: BatchedSequenceCache, seq_id: int, tokens: Sequence[int], start: int,
            chunk: int) -> list[float]:
    """Feed ``tokens`` at positions ``start...`` in steps of at most ``chunk`` tokens."""
    out: list[float] = []
    for at in range(0, len(tokens), chunk):
        part = tokens[at : at + chunk]
        first = start + at
        cache.declare_step(Step.run(first, len(part), seq_id))
        x = [float(EMBED[t]) for t in part]
        for layer in (0, 1):
            qkv = [_qkv(layer, xi, first + i) for i, xi in enumerate(x)]
            seen = cache.write_and_read(layer, [(k, v) for _, k, v in qkv])
            x = [
                xi + _attend(q, [kv for _, kv in keys])
                for xi, (q, _, _), keys in zip(x, qkv, seen)
            ]
        cache.finish_step()
        out.extend(x)
    return out
