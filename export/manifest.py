"""The manifest of an exported HF model (DESIGN section 2), built from its checkpoint.

The schema is ``mlx_pte.ir.manifest.Manifest``, shared with the reader, and the built
manifest is checked by the loader's own ``checked_manifest``, so writer and reader cannot
drift apart: a checkpoint the loader would refuse fails here, before anything is written.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

from mlx_pte.interpreter.text import checked_manifest
from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.manifest import CacheLayerSpec, Manifest
from mlx_pte.ir.quantization import QuantSpec

from .hf_checkpoint import HFCheckpoint, as_ids
from .hf_errors import CheckpointError
from .hf_geometry import HFCacheLayout


def _first_int(*candidates: Any) -> Optional[int]:
    for value in candidates:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _ids(*groups: Any) -> tuple[int, ...]:
    """Every id in ``groups`` (each None, an int or a list), in first-seen order."""
    return tuple(dict.fromkeys(i for group in groups for i in as_ids(group)))


def build_manifest(
    checkpoint: HFCheckpoint,
    layout: HFCacheLayout,
    dtype: str,
    max_step: int,
    quantization: Optional[QuantSpec] = None,
) -> Manifest:
    """Everything a runner needs besides the graph: config, tokens, tokenizer, cache geometry.

    Args:
        checkpoint: the loaded checkpoint.
        layout: its cache layout (one manifest cache entry per ``cache_id``).
        dtype: the exported model dtype name.
        max_step: the most tokens one forward takes.
        quantization: the type linear and embedding weights are quantized to, if any.

    Raises:
        CheckpointError: the config gives no vocab size or context length, or the checkpoint
            gives a manifest the loader would refuse (a bos id past the vocabulary, a chat
            template that does not compile, ...).
    """
    text = checkpoint.config.get_text_config()
    tokenizer = checkpoint.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    vocab_size = getattr(text, "vocab_size", None)
    max_context = getattr(text, "max_position_embeddings", None)
    if not vocab_size or not max_context:
        raise CheckpointError(
            "config.json must give vocab_size and max_position_embeddings to size the runtime"
        )
    vocab_size = int(vocab_size)
    manifest = Manifest(
        config=checkpoint.config_json,
        dtype=dtype,
        vocab_size=vocab_size,
        cache=tuple(
            CacheLayerSpec(
                window=layer.policy.window,
                n_kv_heads=layer.n_kv_heads,
                head_dim=layer.head_dim,
                v_head_dim=layer.v_head_dim,
            )
            for layer in layout.geometry.layers
        ),
        max_step=max_step,
        max_context=int(max_context),
        tokenizer=checkpoint.tokenizer_json,
        # Tokenizers with several named templates are not supported: the runner takes one.
        chat_template=template if isinstance(template, str) and template else None,
        bos_token_id=_first_int(tokenizer.bos_token_id, getattr(text, "bos_token_id", None)),
        eos_token_ids=_sampled_ids(_ids(tokenizer.eos_token_id, checkpoint.generation_eos), vocab_size),
        pad_token_id=_pad_id(_first_int(tokenizer.pad_token_id, getattr(text, "pad_token_id", None))),
        quantization=quantization,
        # Which linears tensor parallelism splits by columns and by rows (ir.sharding).
        extra={"tp_plan": dict(tp_plan)} if (tp_plan := getattr(text, "base_model_tp_plan", None)) else {},
    )
    try:
        return checked_manifest(manifest.to_dict())
    except FormatError as exc:
        raise CheckpointError(f"{exc}, so the exported file would not load; fix the checkpoint") from None


def _pad_id(pad: Optional[int]) -> Optional[int]:
    """HF configs write "no pad token" as -1 (the original LLaMA configs do); the manifest as None.
    A pad id past the vocabulary is kept: it is never embedded (see ``Manifest.from_dict``)."""
    return None if pad is not None and pad < 0 else pad


def _sampled_ids(eos_ids: tuple[int, ...], vocab_size: int) -> tuple[int, ...]:
    """The eos ids the model can produce. HF's generate accepts an eos id past the vocabulary
    and simply never stops on it; the runtime's stop and grammar sets hold only ids the model
    can sample, so such an id is dropped, with a warning."""
    outside = [i for i in eos_ids if not 0 <= i < vocab_size]
    if outside:
        warnings.warn(
            f"eos token id(s) {outside} lie outside the model's {vocab_size} embedding rows and can "
            "never be generated; the exported file leaves them out", stacklevel=3,
        )
    return tuple(i for i in eos_ids if 0 <= i < vocab_size)
