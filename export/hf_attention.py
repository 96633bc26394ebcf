"""HF attention rewritten onto ``llm::update_and_attend``, with no change to modeling code.

Importing this module registers ``ATTN_IMPLEMENTATION`` in transformers' attention
registry and a mask function that returns ``None`` in its mask registry (so HF never
builds a mask tensor, which would be traced at a fixed size; the cache masks). A model
loaded with ``attn_implementation=ATTN_IMPLEMENTATION`` and run with ``use_cache=False``,
explicit ``position_ids`` and the cache layout under ``LAYOUT_KWARG`` (HF forwards extra
model kwargs to every attention call) emits one op per attention layer.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from . import custom_ops  # noqa: F401  (registers torch.ops.llm.update_and_attend)
from .hf_errors import AttentionRoutingError, CheckpointError
from .hf_geometry import HFCacheLayout

ATTN_IMPLEMENTATION = "mlx_pte"
LAYOUT_KWARG = "mlx_pte_cache_layout"


def update_and_attend_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    softcap: Optional[float] = None,
    sliding_window: Optional[int] = None,
    position_ids: Optional[torch.Tensor] = None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function contract: q [B,Hq,T,D], k/v [B,Hkv,T,*] -> ([B,T,Hq,Dv], None).

    ``s_aux`` is gpt-oss's per-head attention sinks ([Hq] logits in the softmax's denominator).
    """
    layout: Optional[HFCacheLayout] = kwargs.get(LAYOUT_KWARG)
    if layout is None or position_ids is None:
        raise AttentionRoutingError(
            f"attention '{ATTN_IMPLEMENTATION}' needs position_ids and {LAYOUT_KWARG}; "
            "run the model through export.hf_wrapper.HFWrapper"
        )
    name = type(module).__name__
    if not getattr(module, "is_causal", True):
        raise CheckpointError(f"{name} attends bidirectionally; only causal decoder-only LMs export")
    if attention_mask is not None:
        raise CheckpointError(
            f"{name} received a custom attention mask; only plain causal attention exports"
        )
    if scaling is None:
        raise CheckpointError(f"{name} passes no attention scaling; this family is not supported")
    cache_id = layout.cache_id(module.layer_idx)
    window = int(sliding_window or 0)
    if window != layout.window(cache_id):
        raise CheckpointError(
            f"layer {module.layer_idx} attends over a window of {window} but its derived cache "
            f"has window {layout.window(cache_id)}; this family's config is not understood"
        )
    out = torch.ops.llm.update_and_attend(
        query,
        key,
        value,
        position_ids.reshape(-1),
        cache_id,
        float(scaling),
        float(softcap or 0.0),
        *(() if s_aux is None else (s_aux,)),
    )
    return out.transpose(1, 2).contiguous(), None


def no_mask(*args: Any, **kwargs: Any) -> None:
    """The cache builds every mask; HF must not."""
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, update_and_attend_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, no_mask)
