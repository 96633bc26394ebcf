"""The ``llm::update_and_attend`` op: one call per attention layer of an exported model.

To the tracer it is functional (no buffers, no mutation): the KV cache lives outside the
graph. Its eager kernel attends through the cache bound with ``bind_cache``, so an
exported program runs eagerly as ``with bind_cache(cache): ep.module()(...)`` against a
cache whose step was declared first.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional

import torch

from mlx_pte.runtime.cache import AttendError, CacheError

OP_NAME = "llm::update_and_attend"

_BOUND: contextvars.ContextVar[Any] = contextvars.ContextVar("mlx_pte_bound_cache", default=None)


class NoCacheBound(CacheError, RuntimeError):
    """update_and_attend ran eagerly with no cache bound."""


@contextlib.contextmanager
def bind_cache(cache: Any) -> Iterator[Any]:
    """Route eager ``update_and_attend`` calls in this block to ``cache``."""
    token = _BOUND.set(cache)
    try:
        yield cache
    finally:
        _BOUND.reset(token)


@torch.library.custom_op(OP_NAME, mutates_args=())
def update_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cache_id: int,
    scale: float,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Write this step's K/V into layer ``cache_id`` and attend ``q`` over its history.

    q ``[1, Hq, T, D]`` (RoPE applied), k ``[1, Hkv, T, D]``, v ``[1, Hkv, T, Dv]``,
    positions ``int64[T]``, sinks ``[Hq]`` or None: per-head logits that join each softmax's
    denominator (gpt-oss). Returns ``[1, Hq, T, Dv]`` in q's dtype.
    """
    cache = _BOUND.get()
    if cache is None:
        raise NoCacheBound(
            "update_and_attend ran with no cache bound; run the program inside "
            "`with bind_cache(cache):` after cache.declare_step(...)"
        )
    declared = cache.step_plan.step.positions
    if tuple(positions.reshape(-1).tolist()) != declared:
        raise AttendError(
            f"the forward's positions {positions.reshape(-1).tolist()} differ from the "
            f"declared step's {list(declared)}"
        )
    if sinks is not None:
        return cache.attend(cache_id, q, k, v, scale, softcap, sinks)
    return cache.attend(cache_id, q, k, v, scale, softcap)


@update_and_attend.register_fake
def _update_and_attend_fake(q, k, v, positions, cache_id, scale, softcap=0.0, sinks=None):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))
