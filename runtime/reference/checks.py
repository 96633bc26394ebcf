"""Validation of an ``attend`` call against the declared step and the layer's geometry.

Backend-neutral: it reads only ``.shape`` and ``.dtype``, which torch and MLX arrays
both have. It runs before anything is written, so a rejected call leaves the cache
exactly as it was.
"""
from __future__ import annotations

from typing import Any

from mlx_pte.runtime.cache import AttendError, CacheBase, LayerGeometry


def check_attend(
    cache: CacheBase, layer: object, q: Any, k: Any, v: Any, softcap: float
) -> LayerGeometry:
    """Check one ``attend`` call; StepStateError with no step declared, else AttendError.

    Args:
        cache: the cache attended; its declared step gives the token count.
        layer: the ``cache_id`` the call names.
        q, k, v: the call's tensors.
        softcap: the call's softcap (0 disables it).

    Returns:
        The layer's geometry.
    """
    tokens = len(cache.step_plan.step)
    geo = cache.layer_geometry(layer)
    shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
    dtypes = (q.dtype, k.dtype, v.dtype)
    for name, shape in zip("qkv", shapes):
        if len(shape) != 4 or shape[0] != 1:
            raise AttendError(
                f"{name} must be [1, heads, tokens, dim], got shape {tuple(shape)}"
            )
        if shape[2] != tokens:
            raise AttendError(
                f"{name} carries {shape[2]} tokens but the declared step has {tokens}; "
                "declare the step the forward runs"
            )
    q, k, v = shapes
    expected = {
        "k heads": (k[1], geo.n_kv_heads),
        "v heads": (v[1], geo.n_kv_heads),
        "q head dim": (q[3], geo.head_dim),
        "k head dim": (k[3], geo.head_dim),
        "v head dim": (v[3], geo.v_head_dim),
    }
    for what, (got, want) in expected.items():
        if got != want:
            raise AttendError(
                f"layer {layer}'s {what} is {want} in the cache geometry, got {got}; "
                "build the cache from the model's geometry"
            )
    if q[1] % geo.n_kv_heads:
        raise AttendError(
            f"q has {q[1]} heads, not a multiple of layer {layer}'s {geo.n_kv_heads} KV heads"
        )
    if len(set(dtypes)) != 1:
        raise AttendError(
            f"q, k and v must share one dtype, got {', '.join(map(str, dtypes))}; "
            "cast them to the model's dtype"
        )
    if not softcap >= 0:
        raise AttendError(f"softcap must be >= 0 (0 disables it), got {softcap!r}")
    return geo
