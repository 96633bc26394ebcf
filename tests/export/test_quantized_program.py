"""Op level: a program exported with quantized weights runs on MLX's quantized kernels and
equals the eager exported program whose weights are the dequantized values (fp32, MLX's
own ``mx.dequantize`` of the stored parts), over every cache kind. The stored parts are
``mx.quantize``'s output bit for bit; weights that cannot be grouped stay full precision;
a tied LM head shares the embedding's one quantized copy.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import mlx_pte.runtime.mlx.blas  # noqa: F401
import mlx.core as mx

from mlx_pte.export.program import export_program
from mlx_pte.interpreter.handlers import CPU_DEQUANTIZE_ROWS
from mlx_pte.interpreter.program import load
from mlx_pte.ir.fuse_projections import ALIGN
from mlx_pte.ir.quantization import QuantSpec, full_precision_weights, quantized_constants
from mlx_pte.runtime.cache import KINDS
from tests.fixtures.dequantized import dequantized_weights, load_into

from .attention_model import HIDDEN, TinyAttentionModel, assert_program_matches_eager, export_tiny_attention

SPECS = {
    "q4": QuantSpec("affine", 4, 32),
    "q8": QuantSpec("affine", 8, 32),
    "mxfp4": QuantSpec("mxfp4", 4, 32),
    "nvfp4": QuantSpec("nvfp4", 4, 16),
}
TOL = 1e-5  # fp32 throughout: only the order of accumulation differs


@pytest.fixture(scope="module")
def model() -> TinyAttentionModel:
    torch.manual_seed(0)
    return TinyAttentionModel().eval()


@pytest.fixture(scope="module")
def model_program(model):
    return export_tiny_attention(model)


@pytest.fixture(scope="module")
def quantized_files(model_program, tmp_path_factory):
    """``quantized_files(name)`` -> the .pte of ``model`` quantized to SPECS[name], exported once."""
    memo = {}

    def get(name: str):
        if name not in memo:
            out = tmp_path_factory.mktemp(name) / "q.pte"
            memo[name] = export_program(model_program, out, quantization=SPECS[name])
        return memo[name]

    return get


@pytest.fixture(scope="module")
def quantized(quantized_files):
    """``quantized(name)`` -> the loaded program of that file."""
    memo = {}

    def get(name: str):
        if name not in memo:
            memo[name] = load(quantized_files(name))
        return memo[name]

    return get


@pytest.fixture(scope="module")
def dequantized_oracle(model, quantized):
    """``dequantized_oracle(name)`` -> the eager exported program of ``model`` with the
    weights of the ``name`` file dequantized."""
    memo = {}

    def get(name: str):
        if name not in memo:
            oracle = copy.deepcopy(model)
            load_into(dequantized_weights(quantized(name)), {"": oracle})
            assert not torch.equal(oracle.lm_head.weight, model.lm_head.weight)  # really dequantized
            memo[name] = export_tiny_attention(oracle).module()
        return memo[name]

    return get


def _mlx(t: torch.Tensor) -> mx.array:
    return mx.array(t.detach().numpy())


def _fused_parts(stored_name: str) -> list[str]:
    """The parameters a stored weight holds: itself, or each projection ``ir.fuse_projections``
    concatenated into it (``layers.0.q+k+v.weight`` holds ``layers.0.q.weight`` ...)."""
    tokens = stored_name.split(".")
    at = next((i for i, t in enumerate(tokens) if "+" in t), None)
    if at is None:
        return [stored_name]
    return [".".join([*tokens[:at], leaf, *tokens[at + 1 :]]) for leaf in tokens[at].split("+")]


def _assert_stored_as_parts_packs(program, qc, parts: list[mx.array], spec: QuantSpec) -> int:
    """Each stored part (weight, scales, biases) of ``qc`` holds ``mx.quantize`` of each of
    ``parts`` (the projections fused into it, in order), each starting at a multiple of
    ``ALIGN`` rows with zero rows between; returns the stored rows."""
    stored = [program.weights[s] for s in qc.slots]
    start = 0
    for i, part in enumerate(parts):
        expected = mx.quantize(part, group_size=spec.group_size, bits=spec.bits, mode=spec.mode)
        assert len(stored) == len(expected)
        for got, want in zip(stored, expected):
            assert got.dtype == want.dtype
            assert mx.array_equal(got[start : start + part.shape[0]], want).item()
        end = start + part.shape[0]
        start = end + (-end % ALIGN if i + 1 < len(parts) else 0)
        assert all(not mx.any(got[end:start]).item() for got in stored)
    assert all(got.shape[0] == start for got in stored)
    return start


@pytest.mark.parametrize("name", SPECS)
def test_every_linear_and_the_embedding_are_stored_as_mx_quantize_packs_them(model, quantized, name):
    program, spec = quantized(name), SPECS[name]
    params = dict(model.named_parameters())
    found = {program.graph.slots[qc.weight].name: qc for qc in quantized_constants(program.graph).values()}
    held = [p for stored in found for p in _fused_parts(stored)]
    assert sorted(held) == sorted(params)  # every weight here is a linear's or the embedding's, stored once
    for stored_name, qc in found.items():
        rows = _assert_stored_as_parts_packs(program, qc, [_mlx(params[p]) for p in _fused_parts(stored_name)], spec)
        width = params[_fused_parts(stored_name)[0]].shape[1]
        assert (qc.spec, qc.shape, qc.dtype) == (spec, (rows, width), "float32")
    assert any("+" in n for n in found)  # the fused projections are checked too
    ops = {i.op for i in program.graph.instructions}
    assert {"quantized_linear", "quantized_embedding"} <= ops and not ops & {"linear", "embedding"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", SPECS)
def test_quantized_program_equals_eager_program_with_dequantized_weights(quantized, dequantized_oracle, name, kind):
    assert_program_matches_eager(quantized(name), dequantized_oracle(name), kind, tol=TOL)


def test_two_exports_are_byte_identical(model_program, quantized_files, tmp_path):
    again = export_program(model_program, tmp_path / "again.pte", quantization=SPECS["q4"])
    assert again.read_bytes() == quantized_files("q4").read_bytes()


class _Mixed(nn.Module):
    """A linear whose 16 input features do not divide into groups of 32, between two that do."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Linear(64, 16)
        self.narrow = nn.Linear(16, 64)
        self.up = nn.Linear(64, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.narrow(self.down(x)))


def test_a_weight_that_does_not_divide_stays_full_precision_and_is_reported(tmp_path):
    torch.manual_seed(0)
    module = _Mixed().eval()
    x = torch.randn(3, 64)
    ep = torch.export.export(module, (x,), dynamic_shapes=({0: torch.export.Dim("rows", max=64)},), strict=False)
    program = load(export_program(ep, tmp_path / "m.pte", quantization=SPECS["q4"]))
    names = {program.graph.slots[qc.weight].name for qc in quantized_constants(program.graph).values()}
    assert names == {"down.weight", "up.weight"}
    assert full_precision_weights(program.graph, SPECS["q4"]) == {
        "narrow.weight": "its 16 columns do not divide into groups of 32"
    }
    assert [i.op for i in program.graph.instructions] == ["quantized_linear", "linear", "quantized_linear"]
    oracle = copy.deepcopy(module)
    load_into(dequantized_weights(program), {"": oracle})
    # Few rows run MLX's quantized matmul; many, on CPU, a dequantized BLAS matmul.
    for rows in (3, CPU_DEQUANTIZE_ROWS, 40):
        x = torch.randn(rows, 64)
        (out,) = program.run([x.numpy()])
        np.testing.assert_allclose(np.array(out), oracle(x).detach().numpy(), rtol=TOL, atol=TOL)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, HIDDEN)
        self.head = nn.Linear(HIDDEN, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))


def test_a_tied_lm_head_shares_the_embeddings_quantized_copy(tmp_path):
    torch.manual_seed(0)
    module = _Tied().eval()
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    ep = torch.export.export(module, (tokens,), strict=False)
    program = load(export_program(ep, tmp_path / "t.pte", quantization=SPECS["q8"]))
    (qc,) = quantized_constants(program.graph).values()
    readers = [i.op for i in program.graph.instructions if qc.weight in i.inputs]
    assert sorted(readers) == ["quantized_embedding", "quantized_linear"]
    assert set(program.weights) == set(qc.slots)  # no second, full-precision copy
    oracle = copy.deepcopy(module)
    load_into(dequantized_weights(program), {"": oracle})
    (out,) = program.run([tokens.numpy()])
    np.testing.assert_allclose(np.array(out), oracle(tokens).detach().numpy(), rtol=TOL, atol=TOL)


def test_bfloat16_weights_quantize_with_bfloat16_scales(model, tmp_path):
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    program = load(export_program(export_tiny_attention(bf16), tmp_path / "bf16.pte", quantization=SPECS["q4"]))
    spec = SPECS["q4"]
    params = dict(bf16.named_parameters())
    for qc in quantized_constants(program.graph).values():
        parts = [params[p].detach() for p in _fused_parts(program.graph.slots[qc.weight].name)]
        assert qc.dtype == "bfloat16"
        _assert_stored_as_parts_packs(program, qc, [mx.array(p.view(torch.uint16).numpy()).view(mx.bfloat16) for p in parts], spec)
