"""Checkpoint validation (one-line typed errors) and the manifest built from a checkpoint."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, T5Config, ViTConfig

from mlx_pte.export.hf_attention import ATTN_IMPLEMENTATION
from mlx_pte.export.hf_checkpoint import load_checkpoint, load_model
from mlx_pte.export.hf_errors import CheckpointError, ExportOptionError
from mlx_pte.export.hf_geometry import cache_layout
from mlx_pte.export.hf_wrapper import HFWrapper, trace
from mlx_pte.export.manifest import build_manifest
from mlx_pte.ir.manifest import Manifest
from tests.fixtures.tiny_models import (
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    PAD_ID,
    SLIDING_WINDOW,
    VOCAB_SIZE,
    build_tiny_checkpoint,
)


def copy_of(tiny_checkpoint, family: str, dst: Path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint(family), dst))


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert message and "\n" not in message
    return message


def test_missing_directory(tmp_path: Path):
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(tmp_path / "absent")
    assert "is not a directory" in one_line_error(excinfo)


@pytest.mark.parametrize(
    ("removed", "says"),
    [
        ("config.json", "has no config.json"),
        ("model.safetensors", "has no *.safetensors weights"),
        ("tokenizer.json", "has no tokenizer.json"),
    ],
)
def test_missing_file(tiny_checkpoint, tmp_path: Path, removed: str, says: str):
    path = copy_of(tiny_checkpoint, "llama", tmp_path / "ckpt")
    (path / removed).unlink()
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(path)
    assert says in one_line_error(excinfo)


def test_corrupt_config(tiny_checkpoint, tmp_path: Path):
    path = copy_of(tiny_checkpoint, "llama", tmp_path / "ckpt")
    (path / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(path)
    assert "is not readable JSON" in one_line_error(excinfo)


def test_unknown_model_type(tiny_checkpoint, tmp_path: Path):
    path = copy_of(tiny_checkpoint, "llama", tmp_path / "ckpt")
    (path / "config.json").write_text(json.dumps({"model_type": "not-a-model"}))
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(path)
    assert "does not load with transformers" in one_line_error(excinfo)


def test_truncated_weights(tiny_checkpoint, tmp_path: Path):
    path = copy_of(tiny_checkpoint, "llama", tmp_path / "ckpt")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError) as excinfo:
        load_model(load_checkpoint(path), "float32", ATTN_IMPLEMENTATION)
    assert "do not load" in one_line_error(excinfo)


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (T5Config(num_layers=1, d_model=32, d_ff=64, num_heads=2, d_kv=16), "encoder-decoder"),
        (ViTConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64), "AutoModelForCausalLM"),
    ],
)
def test_unsupported_architecture_at_load(tiny_checkpoint, tmp_path: Path, config, says: str):
    path = copy_of(tiny_checkpoint, "llama", tmp_path / "ckpt")
    (path / "config.json").write_text(config.to_json_string())
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(path)
    assert says in one_line_error(excinfo)


def test_bidirectional_attention_is_refused_at_trace(tiny_tokenizer, tmp_path: Path):
    """BERT loads as a causal-LM class but attends both ways: the rewrite must refuse it."""
    config = BertConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=128,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    checkpoint = load_checkpoint(tmp_path)
    model = load_model(checkpoint, "float32", ATTN_IMPLEMENTATION)
    with pytest.raises(CheckpointError) as excinfo:
        trace(HFWrapper(model, cache_layout(checkpoint.config)), 8)
    assert "attends bidirectionally" in one_line_error(excinfo)


def test_bad_dtype_and_max_step(tiny_checkpoint):
    checkpoint = load_checkpoint(tiny_checkpoint("llama"))
    with pytest.raises(ExportOptionError, match="dtype must be one of"):
        load_model(checkpoint, "int8", ATTN_IMPLEMENTATION)
    model = load_model(checkpoint, "float32", ATTN_IMPLEMENTATION)
    with pytest.raises(ExportOptionError, match="max_step must be an integer >= 3"):
        trace(HFWrapper(model, cache_layout(checkpoint.config)), 2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_loads_in_dtype_with_the_rewritten_attention(tiny_checkpoint, dtype: str):
    model = load_model(load_checkpoint(tiny_checkpoint("gemma3")), dtype, ATTN_IMPLEMENTATION)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    assert not model.training


def test_manifest_of_a_sliding_family(tiny_checkpoint):
    path = tiny_checkpoint("gemma3")
    checkpoint = load_checkpoint(path)
    manifest = build_manifest(checkpoint, cache_layout(checkpoint.config), "bfloat16", 64)
    # What the fixture wrote, read back independently of the code under test.
    assert manifest.config == json.loads((path / "config.json").read_text())
    assert manifest.tokenizer == (path / "tokenizer.json").read_text()
    assert manifest.chat_template == CHAT_TEMPLATE
    assert (manifest.bos_token_id, manifest.eos_token_ids, manifest.pad_token_id) == (
        BOS_ID, (EOS_ID,), PAD_ID,
    )
    assert (manifest.dtype, manifest.vocab_size, manifest.max_step) == ("bfloat16", VOCAB_SIZE, 64)
    assert manifest.max_context == manifest.config["max_position_embeddings"]
    assert [(c.window, c.n_kv_heads, c.head_dim, c.v_head_dim) for c in manifest.cache] == [
        (SLIDING_WINDOW, 2, 16, 16),
        (0, 2, 16, 16),
    ]
    # JSON-able, and the reader accepts it unchanged.
    assert Manifest.from_dict(json.loads(json.dumps(manifest.to_dict()))) == manifest


def test_manifest_eos_ids_join_tokenizer_and_generation_config(tiny_tokenizer, tmp_path: Path):
    path = build_tiny_checkpoint("llama", tmp_path, tokenizer=tiny_tokenizer)
    generation = json.loads((path / "generation_config.json").read_text())
    generation["eos_token_id"] = [7, EOS_ID, 9]
    (path / "generation_config.json").write_text(json.dumps(generation))
    checkpoint = load_checkpoint(path)
    manifest = build_manifest(checkpoint, cache_layout(checkpoint.config), "float32", 16)
    assert manifest.eos_token_ids == (EOS_ID, 7, 9)


def test_tiny_checkpoints_are_deterministic(tiny_tokenizer, tmp_path: Path):
    first = build_tiny_checkpoint("gemma3", tmp_path / "a", tokenizer=tiny_tokenizer)
    second = build_tiny_checkpoint("gemma3", tmp_path / "b")  # trains its own tokenizer
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
