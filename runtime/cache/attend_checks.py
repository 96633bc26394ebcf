"""Validation of an ``attend`` call against the declared step and the layer's geometry.

Backend-neutral: it reads only ``.shape`` and ``.dtype``, which torch and MLX arrays both
have. It runs before anything is written, so a rejected call leaves the cache exactly as
it was. A call's outcome depends only on its layer, shapes, dtypes, softcap and the step's
token count, so each such signature is checked once per cache and remembered (every layer
of every decode step repeats the same few).
"""
from __future__ import annotations

from typing import Any

from .base import CacheBase
from .config import LayerGeometry
from .errors import AttendError


def check_attend(
    cache: CacheBase, layer: object, q: Any, k: Any, v: Any, softcap: float, sinks: Any = None
) -> LayerGeometry:
    """Check one ``attend`` call.

    Args:
        cache: the cache attended; its declared step gives the token count.
        layer: the ``cache_id`` the call names.
        q, k, v: the call's arrays.
        softcap: the call's softcap (0 disables it).
        sinks: the call's per-query-head sink logits, or None.

    Returns:
        The layer's geometry.

    Raises:
        StepStateError: no step is declared.
        AttendError: anything else that does not match.
    """
    tokens = len(cache.step_plan.step)
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise AttendError(
            f"sinks must hold one logit per query head, [{q.shape[1]}], got shape {tuple(sinks.shape)}"
        )
    try:
        signature = (type(layer), layer, tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, k.dtype, v.dtype,
                     softcap, tokens)
        known = cache.checked_attends.get(signature)
    except TypeError:  # an unhashable layer or softcap: the full check explains it
        signature, known = None, None
    if known is not None:
        return known
    geo = _check(cache, layer, q, k, v, softcap, tokens)
    if signature is not None:
        cache.checked_attends[signature] = geo
    return geo


def _check(cache: CacheBase, layer: object, q: Any, k: Any, v: Any, softcap: float, tokens: int) -> LayerGeometry:
    geo = cache.layer_geometry(layer)
    for name, a in (("q", q), ("k", k), ("v", v)):
        shape = tuple(a.shape)
        if len(shape) != 4 or shape[0] != 1:
            raise AttendError(f"{name} must be [1, heads, tokens, dim], got shape {shape}")
        if shape[2] != tokens:
            raise AttendError(
                f"{name} carries {shape[2]} tokens but the declared step has {tokens}; "
                "declare the step the forward runs"
            )
    expected = {
        "k heads": (k.shape[1], geo.n_kv_heads),
        "v heads": (v.shape[1], geo.n_kv_heads),
        "q head dim": (q.shape[3], geo.head_dim),
        "k head dim": (k.shape[3], geo.head_dim),
        "v head dim": (v.shape[3], geo.v_head_dim),
    }
    for what, (got, want) in expected.items():
        if got != want:
            raise AttendError(
                f"layer {layer}'s {what} is {want} in the cache geometry, got {got}; "
                "build the cache from the model's geometry"
            )
    if q.shape[1] % geo.n_kv_heads:
        raise AttendError(
            f"q has {q.shape[1]} heads, not a multiple of layer {layer}'s {geo.n_kv_heads} KV heads"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise AttendError(
            f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; "
            "cast them to the model's dtype"
        )
    if not softcap >= 0:
        raise AttendError(f"softcap must be >= 0 (0 disables it), got {softcap!r}")
    return geo
