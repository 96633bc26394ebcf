"""Cache geometry of a Hugging Face model, derived from its config.

This is the one place that knows how families spell their attention layout:
``layer_types`` (``sliding_attention`` = ring of ``sliding_window``, ``full_attention`` =
flat), all-sliding when ``sliding_window`` is set without ``layer_types`` (Mistral, as
HF itself reads it), ``head_dim`` (or hidden / heads), ``num_key_value_heads``, and KV
sharing (``num_kv_shared_layers``: the last layers reuse the K/V of the last earlier
layer of the same type, so they read and write that layer's cache).
"""
from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from mlx_pte.runtime.cache import CacheGeometry, LayerGeometry, LayerPolicy

from .hf_errors import CheckpointError

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class HFCacheLayout:
    """The model's caches and which cache each HF layer uses.

    Attributes:
        geometry: one entry per ``cache_id``.
        layer_cache_ids: per HF layer index, the ``cache_id`` its attention uses.
    """

    geometry: CacheGeometry
    layer_cache_ids: tuple[int, ...]

    def cache_id(self, layer: int) -> int:
        return self.layer_cache_ids[layer]

    def window(self, cache_id: int) -> int:
        """The cache's window: 0 = flat."""
        return self.geometry.layers[cache_id].policy.window


def layer_types(text: PretrainedConfig) -> tuple[str, ...]:
    """Each layer's attention type, read as HF reads it."""
    n = text.num_hidden_layers
    declared = getattr(text, "layer_types", None)
    if declared is not None:
        if len(declared) != n:
            raise CheckpointError(
                f"config.json lists {len(declared)} layer_types for {n} layers; fix the config"
            )
        return tuple(declared)
    return (SLIDING if getattr(text, "sliding_window", None) else FULL,) * n


def _policy(layer: int, kind: str, text: PretrainedConfig) -> LayerPolicy:
    if kind == FULL:
        return LayerPolicy.flat()
    if kind == SLIDING:
        window = getattr(text, "sliding_window", None)
        if not window:
            raise CheckpointError(
                f"layer {layer} is a sliding-attention layer but config.json sets no sliding_window"
            )
        return LayerPolicy.ring(int(window))
    raise CheckpointError(
        f"layer {layer} is a '{kind}' layer; only full and sliding attention layers export"
    )


def _layer_cache_ids(types: tuple[str, ...], n_shared: int) -> tuple[int, ...]:
    """Identity for owning layers; a KV-sharing layer maps to the last owner of its type."""
    n_owners = len(types) - n_shared
    ids = list(range(n_owners))
    for layer in range(n_owners, len(types)):
        donors = [i for i in range(n_owners) if types[i] == types[layer]]
        if not donors:
            raise CheckpointError(
                f"layer {layer} shares the K/V of a '{types[layer]}' layer, but no earlier layer "
                "of that type owns a cache; fix num_kv_shared_layers in config.json"
            )
        ids.append(donors[-1])
    return tuple(ids)


def cache_layout(config: PretrainedConfig) -> HFCacheLayout:
    """The cache geometry of ``config`` (its text config for multimodal models).

    Raises:
        CheckpointError: a layer type the cache cannot hold, or an inconsistent config.
    """
    text = config.get_text_config()
    for field in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if getattr(text, field, None) is None:
            raise CheckpointError(
                f"config.json has no {field}; only transformer attention LMs export"
            )
    types = layer_types(text)
    n_shared = int(getattr(text, "num_kv_shared_layers", 0) or 0)
    if not 0 <= n_shared < len(types):
        raise CheckpointError(
            f"num_kv_shared_layers={n_shared} must leave at least one of {len(types)} layers "
            "owning a cache"
        )
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    n_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    owners = types[: len(types) - n_shared]
    layers = tuple(
        LayerGeometry(_policy(i, kind, text), int(n_kv_heads), int(head_dim), int(head_dim))
        for i, kind in enumerate(owners)
    )
    return HFCacheLayout(CacheGeometry(layers), _layer_cache_ids(types, n_shared))
