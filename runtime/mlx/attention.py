"""Attention over a window the cache has already read and masked.

On CPU, compute is fp32 whatever the storage or model dtype: MLX's bf16/fp16 CPU matmuls
are far slower than fp32, and the oracle computes in fp32 too. On a GPU the fused kernel
runs in the model's dtype (it accumulates in fp32 itself): an fp32 upcast would cost
three casts per layer and keep a half-precision prefill off cuDNN's fused attention.
Softcapped scores are always fp32 (they are explicit). GQA is native (K/V are never
tiled), and V's head dim may differ from K's.
"""
from __future__ import annotations

from typing import Optional

from mlx_pte.runtime.mlx.bootstrap import mx

from .masks import Mask, lower_right_mask
from .pool import cast


def attend(
    q: mx.array, k: mx.array, v: mx.array, scale: float, softcap: float, mask: Mask,
    sinks: Optional[mx.array] = None,
) -> mx.array:
    """softmax(mask(cap(q k^T * scale))) v.

    Args:
        q: [B, Hq, T, D].
        k: [B, Hkv, S, D], any float dtype (storage).
        v: [B, Hkv, S, Dv].
        scale: multiplies q.k.
        softcap: > 0 replaces scores s by ``softcap * tanh(s / softcap)``.
        mask: None, ``"causal"`` (lower-right) or bool broadcastable to [B, 1, T, S].
        sinks: [Hq] logits, one per query head, that join each softmax's denominator and
            attend to nothing (gpt-oss), or None.

    Returns:
        [B, Hq, T, Dv] in q's dtype.
    """
    out_dtype = q.dtype
    compute = mx.float32 if softcap > 0 or mx.default_device() == mx.cpu else q.dtype
    q, k, v = (cast(a, compute) for a in (q, k, v))
    sinks = None if sinks is None else cast(sinks, compute)
    if softcap > 0:
        out = _softcapped(q, k, v, scale, softcap, mask, sinks)
    else:
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
    return cast(out, out_dtype)


def _softcapped(
    q: mx.array, k: mx.array, v: mx.array, scale: float, softcap: float, mask: Mask,
    sinks: Optional[mx.array],
) -> mx.array:
    """Explicit scores, because the fused kernel cannot cap them before the softmax."""
    batch, q_heads, tokens, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = q_heads // kv_heads
    # q head h reads kv head h // groups: group the query heads under their kv head.
    grouped = q.reshape(batch, kv_heads, groups * tokens, dim)
    scores = (grouped * scale) @ k.swapaxes(-1, -2)
    scores = softcap * mx.tanh(scores / softcap)
    scores = scores.reshape(batch, kv_heads, groups, tokens, keys)
    if isinstance(mask, str):  # only CAUSAL exists
        mask = lower_right_mask(tokens, keys)
    if mask is not None:
        # A finite floor keeps a fully masked (padding) query finite instead of NaN.
        floor = mx.array(mx.finfo(mx.float32).min, mx.float32)
        scores = mx.where(mx.expand_dims(mask, 2), scores, floor)
    if sinks is not None:  # head h = (kv head h // groups, group h % groups)
        sink = mx.broadcast_to(sinks.reshape(1, kv_heads, groups, 1, 1), (*scores.shape[:-1], 1))
        probs = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1, precise=True)[..., :-1]
    else:
        probs = mx.softmax(scores, axis=-1, precise=True)
    out = probs.reshape(batch, kv_heads, groups * tokens, keys) @ v
    return out.reshape(batch, q_heads, tokens, v.shape[-1])
