"""Attention in fp32 over a window read in logical order, and the masks it needs.

This is the oracle: scores are computed explicitly (no fused kernel whose mask alignment
could differ), GQA repeats K/V heads, and every mask is a bool tensor, True = attend.
"""
from __future__ import annotations

from typing import Optional

import torch

from mlx_pte.runtime.cache import MaskKind, RunPlan

STORAGE_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def lower_right_mask(queries: int, keys: int, window: int = 0) -> torch.Tensor:
    """bool [queries, keys]: the newest key belongs to the last query.

    Query i sees key j iff ``j <= i + keys - queries`` and, for ``window > 0``, also
    ``j >= i + keys - queries - window + 1``. (torch's ``is_causal`` is upper-left
    aligned, which is wrong for a continuation over a longer history.)
    """
    offset = torch.arange(keys)[None, :] - torch.arange(queries)[:, None]
    newest = keys - queries
    mask = offset <= newest
    if window:
        mask &= offset >= newest - window + 1
    return mask


def run_mask(run: RunPlan) -> Optional[torch.Tensor]:
    """The mask a sequence-layout run needs (None: every key read is visible)."""
    if run.mask is MaskKind.NONE:
        return None
    window = run.window if run.mask is MaskKind.BAND else 0
    return lower_right_mask(run.count, run.read_len, window)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float,
    mask: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attend q over k/v in fp32.

    Args:
        q: [1, Hq, T, D].
        k: [1, Hkv, S, D], any float dtype (storage).
        v: [1, Hkv, S, Dv].
        scale: multiplies q.k.
        softcap: > 0 replaces scores s by ``softcap * tanh(s / softcap)``.
        mask: bool [T, S], True = attend, or None.
        sinks: [Hq] logits, one per query head, that join each softmax's denominator and
            attend to nothing (gpt-oss), or None.

    Returns:
        [1, Hq, T, Dv] in q's dtype.
    """
    groups = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(groups, dim=1)
    values = v.float().repeat_interleave(groups, dim=1)
    scores = (q.float() @ keys.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return (scores.softmax(dim=-1) @ values).to(q.dtype)
    sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return (probs @ values).to(q.dtype)
