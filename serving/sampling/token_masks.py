"""Allowed-token bitmasks applied to logits on the device (MLX).

A mask row is ``ceil(V / 32)`` int32 words; token ``t`` is allowed when bit ``t % 32`` of
word ``t // 32`` is set (the layout ``grammar.Matcher.fill_mask`` writes). Only the packed
words go to the device (V / 8 bytes a row); they are unpacked there, so a batch mixing
constrained and unconstrained rows (an all-ones row) is one op over ``[N, V]``.
"""
from __future__ import annotations

import numpy as np

from mlx_pte.runtime.mlx.bootstrap import mx

# Data, not a lazy op: a module-level graph would belong to the importing thread's stream.
_BITS = mx.array(np.arange(32, dtype=np.uint32))


def allowed(masks: np.ndarray, vocab_size: int) -> mx.array:
    """bool ``[N, V]`` (lazy): which tokens each row of packed ``masks`` allows."""
    words = mx.array(np.ascontiguousarray(masks).view(np.uint32))
    bits = (words[:, :, None] >> _BITS) & 1  # [N, W, 32]: word w, bit b is token 32 w + b
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].astype(mx.bool_)


def apply_masks(logits: mx.array, masks: np.ndarray) -> mx.array:
    """``logits`` ``[N, V]`` with every token its mask row forbids set to -inf (lazy)."""
    if masks.shape[0] != logits.shape[0]:
        raise ValueError(f"{masks.shape[0]} mask rows for {logits.shape[0]} rows of logits")
    return mx.where(allowed(masks, logits.shape[-1]), logits, -mx.inf)
