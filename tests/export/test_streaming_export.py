"""The streaming export: a weightless skeleton traces the real model's graph, weights reach
the file one at a time (bounded memory), and the same checkpoint always gives the same bytes.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import mlx_pte.runtime.mlx.blas  # noqa: F401  (load an optimized BLAS before mlx.core)
import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mlx_pte.export import quantize as quantize_module
from mlx_pte.export.hf_attention import ATTN_IMPLEMENTATION
from mlx_pte.export.hf_checkpoint import load_checkpoint, load_model, load_skeleton, weight_sources
from mlx_pte.export.hf_errors import CheckpointError
from mlx_pte.export.hf_export import export_hf
from mlx_pte.export.hf_geometry import cache_layout
from mlx_pte.export.hf_wrapper import HFWrapper, trace
from mlx_pte.export.safetensors_file import CheckpointTensor, SafetensorsFiles
from mlx_pte.export.tensor_source import ArraySource
from mlx_pte.interpreter.program import load
from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.payload import WEIGHTS_KEY, decode_payload
from mlx_pte.ir.pte import read_program
from mlx_pte.ir.quantization import QuantSpec, quantized_constants
from tests.fixtures.exported import exported_pte
from tests.fixtures.tiny_models import edit_config

REPO = Path(__file__).resolve().parents[2]
MB = 1 << 20


def _bench():
    spec = importlib.util.spec_from_file_location("export_memory", REPO / "bench" / "export_memory.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["export_memory"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", ["llama", "gemma3n", "gpt_oss"])
def test_the_skeleton_traces_the_graph_the_real_model_traces(tiny_checkpoint, family):
    checkpoint = load_checkpoint(tiny_checkpoint(family))
    layout = cache_layout(checkpoint.config)
    skeleton = HFWrapper(load_skeleton(checkpoint, "bfloat16", ATTN_IMPLEMENTATION), layout)
    real = HFWrapper(load_model(checkpoint, "bfloat16", ATTN_IMPLEMENTATION), layout)
    a, b = trace(skeleton, 8), trace(real, 8)
    assert a.graph_module.code == b.graph_module.code
    assert str(a.graph_signature) == str(b.graph_signature)
    # Every weight is named after its checkpoint tensor and reads as the real model's value;
    # the computed buffers (rotary frequencies, scales) equal from_pretrained's.
    sources = weight_sources(skeleton)
    real_state = {**dict(real.named_parameters(remove_duplicate=False)), **dict(real.named_buffers())}
    assert set(sources) | {n for n, _ in skeleton.named_buffers()} == set(real_state)
    for name, source in sources.items():
        assert torch.equal(source.tensor(), real_state[name]), name
    for name, buffer in skeleton.named_buffers():
        if name not in sources:
            assert torch.equal(buffer, real_state[name]) and buffer.dtype == real_state[name].dtype, name


# Two exports per case (~10 s for bf16, ~8 s for q4): the slow tier's.
@pytest.mark.slow
@pytest.mark.parametrize("quantize", [None, QuantSpec.from_preset("q4", 32)], ids=["bf16", "q4"])
def test_two_exports_of_one_checkpoint_are_byte_identical(tiny_checkpoint, tmp_path, quantize):
    source = tiny_checkpoint("qwen3")
    first = export_hf(source, tmp_path / "a.pte", dtype="bfloat16", max_step=8, progress=False, quantize=quantize)
    second = export_hf(source, tmp_path / "b.pte", dtype="bfloat16", max_step=8, progress=False, quantize=quantize)
    assert first.read_bytes() == second.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pte", "b.pte"]  # no temp file left


def _whole_weight_packing(weight: torch.Tensor) -> list[bytes]:
    parts = mx.quantize(mx.array(weight.view(torch.uint16).numpy()).view(mx.bfloat16), group_size=32, bits=4)
    return [np.array(p.view(mx.uint16) if p.dtype == mx.bfloat16 else p).tobytes() for p in parts]


def test_quantizing_in_row_blocks_gives_mlx_s_packing_of_the_whole_weight(monkeypatch):
    weight = torch.randn(37, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    monkeypatch.setattr(quantize_module, "_QUANTIZE_BLOCK_BYTES", 5 * 64 * 2)  # 5 rows a block
    blocks = quantize_module._quantize_blocks(ArraySource(weight), QuantSpec.from_preset("q4", 32))
    assert [b.tobytes() for b in blocks] == _whole_weight_packing(weight)


def test_a_checkpoint_weight_is_quantized_from_row_blocks_never_read_whole(monkeypatch, tmp_path):
    weight = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    save_file({"w": weight}, tmp_path / "model.safetensors")
    files = SafetensorsFiles(tmp_path)
    reads: list[tuple[int, int]] = []
    read_rows = CheckpointTensor.rows

    def rows(self, start, stop):
        reads.append((start, stop))
        return read_rows(self, start, stop)

    def whole(self):
        raise AssertionError("the whole weight was read")

    monkeypatch.setattr(CheckpointTensor, "rows", rows)
    monkeypatch.setattr(CheckpointTensor, "tensor", whole)
    monkeypatch.setattr(quantize_module, "_QUANTIZE_BLOCK_BYTES", 5 * 64 * 2)
    source = CheckpointTensor(files, "w", (37, 64), "bfloat16")
    blocks = quantize_module._quantize_blocks(source, QuantSpec.from_preset("q4", 32))
    assert [b.tobytes() for b in blocks] == _whole_weight_packing(weight)
    assert reads == [(i, min(i + 5, 37)) for i in range(0, 37, 5)]


def test_a_version_2_payload_without_its_weights_is_refused(tiny_checkpoint, tmp_path_factory):
    out = exported_pte(tmp_path_factory, tiny_checkpoint, "llama")
    contents = read_program(out.read_bytes())
    assert WEIGHTS_KEY in contents.named_data
    with pytest.raises(FormatError, match="weights .* are missing or truncated"):
        decode_payload(contents.payload, {})
    short = {WEIGHTS_KEY: contents.named_data[WEIGHTS_KEY][:-1]}
    with pytest.raises(FormatError, match="missing or truncated"):
        decode_payload(contents.payload, short)


def test_a_checkpoint_missing_a_weight_is_refused_before_anything_is_written(tmp_path):
    root = tmp_path / "ckpt"
    _bench().write_zero_checkpoint(root, "135m", num_hidden_layers=1, vocab_size=64, hidden_size=64,
                                   intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32)  # fmt: skip
    edit_config(root, num_hidden_layers=2)  # weights hold 1 layer
    with pytest.raises(CheckpointError, match="has no tensor 'model.layers.1.self_attn.q_proj.weight'"):
        export_hf(root, tmp_path / "m.pte", max_step=8, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.slow  # ~16 s: a 135M-shaped export in a child process
def test_export_peak_memory_is_bounded_by_the_largest_tensor_not_the_model(tmp_path):
    """A SmolLM2-135M-shaped bf16 checkpoint (4 of its 30 layers: 85 MB of weights, the
    embedding 57 MB of them), exported in a child whose resident set is polled from outside.
    Holding the model even once would add its 85 MB to the copies a writer makes."""
    bench = _bench()
    shapes = bench.write_zero_checkpoint(tmp_path / "ckpt", "135m", num_hidden_layers=4)
    largest = max(2 * int(np.prod(s)) for s in shapes.values())
    imports = bench.run_measured([sys.executable, "-c", "import mlx_pte.cli, mlx_pte.export.hf_export"])
    export = bench.run_measured(
        [sys.executable, "-m", "mlx_pte", "export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "m.pte"),
         "--dtype", "bfloat16", "--no-progress"]
    )  # fmt: skip
    added = export.peak_rss - imports.peak_rss
    assert added <= 2 * largest + 64 * MB, (
        f"the export peaked {added / MB:.0f} MB above its imports; the largest tensor is {largest / MB:.0f} MB, "
        f"the weights {bench.weight_bytes(shapes) / MB:.0f} MB"
    )


def test_the_bench_parses_its_arguments():
    done = subprocess.run([sys.executable, str(REPO / "bench" / "export_memory.py"), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--baseline-python" in done.stdout


def test_a_tied_embedding_and_fused_projections_quantize_from_row_blocks(tmp_path, monkeypatch):
    """The head shares the embedding: one packed copy, read a block of rows at a time like
    every fused projection part, never whole; its packs are MLX's of the checkpoint's table."""
    root = tmp_path / "ckpt"
    shapes = _bench().write_zero_checkpoint(root, "135m", num_hidden_layers=1, vocab_size=96, hidden_size=64,
                                            intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                                            head_dim=32)  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    weights = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in shapes.items()}
    save_file(weights, root / "model.safetensors")
    whole_reads: list[str] = []
    read_whole = CheckpointTensor.tensor

    def tensor(self):
        whole_reads.append(self.key)
        return read_whole(self)

    monkeypatch.setattr(CheckpointTensor, "tensor", tensor)
    monkeypatch.setattr(quantize_module, "_QUANTIZE_BLOCK_BYTES", 7 * 64 * 2)  # 7 rows a block
    spec = QuantSpec.from_preset("q4", 32)
    out = export_hf(root, tmp_path / "m.pte", dtype="bfloat16", max_step=8, progress=False, quantize=spec)
    assert not [k for k in whole_reads if k.endswith("proj.weight") or "embed" in k]  # norms only
    program = load(out)
    packed = {program.graph.slots[qc.weight].name: qc for qc in quantized_constants(program.graph).values()}
    embedding = [n for n, qc in packed.items() if qc.shape == shapes["model.embed_tokens.weight"]]
    assert len(embedding) == 1  # the embedding and the head read one packed copy
    assert {n.rpartition(".")[0].rpartition(".")[2] for n in packed} >= {"qkv_proj", "gate_up_proj"}
    stored = [program.weights[s] for s in packed[embedding[0]].slots]
    got = [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes() for a in stored]
    assert got == _whole_weight_packing(weights["model.embed_tokens.weight"])
