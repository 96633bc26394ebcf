"""Cache geometry derived from each family's config, checked against hand-written answers."""
from __future__ import annotations

import pytest
from transformers import Gemma3nTextConfig, LlamaConfig, Qwen3Config

from mlx_pte.export.hf_errors import CheckpointError
from mlx_pte.export.hf_geometry import cache_layout
from mlx_pte.runtime.cache import CacheGeometry, LayerGeometry, LayerPolicy
from tests.fixtures.tiny_models import FAMILIES, SLIDING_WINDOW, tiny_config

FLAT = LayerPolicy.flat()
RING = LayerPolicy.ring(SLIDING_WINDOW)

# Each tiny family's caches and the cache each layer uses; 2 KV heads of dim 16 everywhere.
EXPECTED = {
    "llama": ((FLAT, FLAT), (0, 1)),
    "qwen3": ((FLAT, FLAT), (0, 1)),
    "mistral": ((RING, RING), (0, 1)),  # sliding_window without layer_types: all sliding
    "gemma3": ((RING, FLAT), (0, 1)),
    "gemma2": ((RING, FLAT), (0, 1)),
    "gemma3n": ((RING, FLAT), (0, 1, 0, 1)),  # layers 2, 3 share the K/V of 0, 1
    "qwen3_moe": ((FLAT, FLAT), (0, 1)),
    "mixtral": ((FLAT, FLAT), (0, 1)),
    "olmoe": ((FLAT, FLAT), (0, 1)),
    "qwen2_moe": ((FLAT, FLAT), (0, 1)),
    "gpt_oss": ((RING, FLAT), (0, 1)),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_geometry(family: str):
    policies, layer_cache_ids = EXPECTED[family]
    layout = cache_layout(tiny_config(family))
    assert layout.geometry == CacheGeometry(
        tuple(LayerGeometry(p, n_kv_heads=2, head_dim=16, v_head_dim=16) for p in policies)
    )
    assert layout.layer_cache_ids == layer_cache_ids
    assert [layout.window(i) for i in range(2)] == [p.window for p in policies]


def test_head_dim_defaults_to_hidden_over_heads_and_kv_heads_to_heads():
    config = LlamaConfig(hidden_size=96, num_attention_heads=3, num_hidden_layers=1)
    # Older checkpoints omit both; LlamaConfig would fill them in, so unset them here.
    config.head_dim = None
    config.num_key_value_heads = None
    (layer,) = cache_layout(config).geometry.layers
    assert (layer.n_kv_heads, layer.head_dim, layer.v_head_dim) == (3, 32, 32)


def test_qwen3_sliding_layers_follow_layer_types():
    config = Qwen3Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2,
        head_dim=16, num_key_value_heads=2,
    )
    # HF's own reading of this config: the layers past max_window_layers slide.
    assert config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    ring8 = LayerPolicy.ring(8)
    assert cache_layout(config).geometry.policies == (FLAT, FLAT, ring8, ring8)


def test_kv_shared_layers_use_the_last_owner_of_their_type():
    config = Gemma3nTextConfig(
        num_hidden_layers=6,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention", "full_attention", "sliding_attention"],
        sliding_window=4, head_dim=16, num_key_value_heads=2, num_attention_heads=4,
        hidden_size=64,
    )
    layout = cache_layout(config)
    # Owners 0..3 keep their own caches; layer 4 (full) reuses 3, layer 5 (sliding) reuses 2.
    assert layout.layer_cache_ids == (0, 1, 2, 3, 3, 2)
    assert layout.geometry.policies == (LayerPolicy.ring(4), FLAT, LayerPolicy.ring(4), FLAT)
    # HF's own view of who stores the shared K/V agrees.
    assert [i for i, mode in enumerate(config.kv_sharing_modes) if mode == "store"] == [2, 3]


def test_unsupported_layer_type_is_refused():
    config = Qwen3Config(num_hidden_layers=2, head_dim=16)
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(CheckpointError, match="layer 1 is a 'linear_attention' layer"):
        cache_layout(config)


def test_sliding_layer_without_window_is_refused():
    config = Qwen3Config(num_hidden_layers=2, head_dim=16)
    config.layer_types = ["sliding_attention", "full_attention"]
    config.sliding_window = None
    with pytest.raises(CheckpointError, match="sets no sliding_window"):
        cache_layout(config)
