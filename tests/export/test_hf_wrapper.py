"""The traced wrapper's graph, and the guards that refuse a layout the model disagrees with."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mlx_pte.export.hf_attention import ATTN_IMPLEMENTATION
from mlx_pte.export.hf_checkpoint import load_checkpoint, load_model
from mlx_pte.export.hf_errors import AttentionRoutingError, CheckpointError
from mlx_pte.export.hf_geometry import HFCacheLayout, cache_layout
from mlx_pte.export.hf_wrapper import HFWrapper, trace
from mlx_pte.runtime.cache import CacheGeometry, LayerGeometry, LayerPolicy

MAX_STEP = 8


def loaded(tiny_checkpoint, family: str):
    checkpoint = load_checkpoint(tiny_checkpoint(family))
    return load_model(checkpoint, "float32", ATTN_IMPLEMENTATION), cache_layout(checkpoint.config)


def test_graph_is_cache_free_with_one_attention_call_per_layer(tiny_checkpoint):
    model, layout = loaded(tiny_checkpoint, "qwen3")
    ep = trace(HFWrapper(model, layout), MAX_STEP)
    calls = [n for n in ep.graph.nodes if n.target == torch.ops.llm.update_and_attend.default]
    assert [n.args[4] for n in calls] == [0, 1]
    # head_dim 16: HF's scaling is 16**-0.5; qwen3 has no softcap (the op's default, 0.0,
    # is left out of the node's arguments).
    assert [n.args[5:] for n in calls] == [(0.25,), (0.25,)]
    assert not ep.graph_signature.buffers_to_mutate
    inputs = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    assert inputs == ["tokens", "positions", "rows"]
    # T and R are independent symbols bounded by max_step.
    assert {str(r) for r in ep.range_constraints.values()} == {f"VR[1, {MAX_STEP}]"}
    assert len(ep.range_constraints) == 2


def with_layers(layout: HFCacheLayout, layers, layer_cache_ids=None) -> HFCacheLayout:
    return dataclasses.replace(
        layout,
        geometry=CacheGeometry(tuple(layers)),
        layer_cache_ids=layer_cache_ids if layer_cache_ids is not None else layout.layer_cache_ids,
    )


def test_a_layout_with_more_layers_than_the_model_is_refused(tiny_checkpoint):
    model, layout = loaded(tiny_checkpoint, "llama")
    wrong = with_layers(layout, layout.geometry.layers * 2, (0, 1, 2, 3))
    says = r"attends through caches \[0, 1\], but its config gives \[0, 1, 2, 3\]"
    with pytest.raises(CheckpointError, match=says):
        trace(HFWrapper(model, wrong), MAX_STEP)


def test_a_layout_with_the_wrong_head_dim_is_refused(tiny_checkpoint):
    model, layout = loaded(tiny_checkpoint, "llama")
    wrong = with_layers(layout, [LayerGeometry(LayerPolicy.flat(), 2, 8, 8)] * 2)
    says = r"receives .* = \(2, 16, 16\), but the config gives \(2, 8, 8\)"
    with pytest.raises(CheckpointError, match=says):
        trace(HFWrapper(model, wrong), MAX_STEP)


def test_a_layout_missing_the_sliding_window_is_refused(tiny_checkpoint):
    model, layout = loaded(tiny_checkpoint, "mistral")
    wrong = with_layers(layout, [LayerGeometry(LayerPolicy.flat(), 2, 16, 16)] * 2)
    says = "attends over a window of 4 but its derived cache has window 0"
    with pytest.raises(CheckpointError, match=says):
        trace(HFWrapper(model, wrong), MAX_STEP)


def test_the_rewritten_attention_outside_the_wrapper_says_how_to_run_it(tiny_checkpoint):
    model, _ = loaded(tiny_checkpoint, "llama")
    with pytest.raises(AttentionRoutingError, match="HFWrapper"):
        model(torch.tensor([[5, 6, 7]]), use_cache=False)
