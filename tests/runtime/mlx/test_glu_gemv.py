"""The GEMV kernel that builds its row as a GLU, act(gate) * up (``gemv.glu_gemv``), and
the fused ops (``glu_linear``, ``glu_quantized_linear``) that take it.

The oracle is numpy in float64 from the values as stored, rounded where the ``glu`` op
rounds (the activation to the dtype, then its product with up), times the weight (MLX's own
dequantize for 4-bit weights). gate and up come apart or as halves of one fused gate/up row,
with padding between. On CUDA the kernels run there (``bench/gpu_suite.sh`` step
``gpu_tests``, the model's MLP shape too), elsewhere in ``cuda_emulation``; the default run
covers each value once, ``-m slow`` every combination (see ``test_gemv.py``).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.interpreter.handlers import HANDLERS, RunContext
from mlx_pte.runtime.mlx import gemv, gemv_rows
from tests.runtime.mlx import cuda_emulation
from tests.runtime.mlx.gemv_cases import (DTYPES, TILINGS, assert_close, dequantized, emulated, gpu_shapes, grid,
                                          oracle, quantized, stored)
from tests.runtime.mlx.gemv_cases import gpu_kernels, kernels_on  # noqa: F401  (fixtures)

ACTIVATIONS = list(gemv_rows.GLU_ACTIVATIONS)
_ERF = np.vectorize(math.erf)


def glu_row_oracle(gate: mx.array, up: mx.array, activation: str) -> mx.array:
    """act(gate) * up by the glu op's rule: the activation in float64 here, rounded to the
    dtype, times up, rounded again (MLX's casts round)."""
    g = np.array(gate.astype(mx.float32), dtype=np.float64)
    act = {
        "silu": lambda: g / (1 + np.exp(-g)),
        "gelu": lambda: 0.5 * g * (1 + _ERF(g / math.sqrt(2))),
        "gelu_tanh": lambda: 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))),
    }[activation]()
    rounded = stored(act, gate.dtype)
    return (rounded.astype(mx.float32) * up.astype(mx.float32)).astype(gate.dtype)


# How gate and up reach the kernel: halves of one fused row (16 features of padding between,
# so up starts on 16 bytes; or 3, so it does not), two rows, or two strided views.
FORMS = ["fused", "fused_odd", "apart", "strided"]


def gate_and_up(width: int, form: str, dtype: mx.Dtype, seed: int) -> tuple[mx.array, mx.array | None, mx.array,
                                                                              mx.array]:
    """(the kernel's gate and up operands, up None where gate holds both; the gate and up
    rows they hold) in ``form``."""
    rng = np.random.default_rng(seed)
    cast = lambda a: stored(a, dtype)  # noqa: E731
    if form.startswith("fused"):
        both = cast(rng.standard_normal((1, 1, 2 * width + (16 if form == "fused" else 3))) * 2)
        return both, None, both[..., :width], both[..., -width:]
    step = 2 if form == "strided" else 1
    gate = cast(rng.standard_normal((1, 1, step * width)) * 2)[..., ::step]
    up = cast(rng.standard_normal((1, 1, step * width)))[..., ::step]
    return gate, up, gate, up


@pytest.mark.parametrize("activation,form,tiling,dtype,shape", grid(ACTIVATIONS, FORMS, TILINGS[:2], DTYPES,
                                                                     gpu_shapes([(37, 264), (9, 100), (24, 8192)],
                                                                                [(2048, 8192)])))
def test_the_fused_glu_matches_the_ops_it_replaces(activation, form, tiling, dtype, shape, gpu_kernels):
    out_features, width = shape
    rng = np.random.default_rng(out_features + width)
    weight = stored(rng.standard_normal((out_features, width)) / np.sqrt(width), dtype)
    gate, up, gate_row, up_row = gate_and_up(width, form, dtype, width)
    assert gemv.glu_available(gate, up, width, activation, weight)
    got = gemv.glu_gemv(gate, up, width, activation, weight, layout=tiling)
    assert_close(got, glu_row_oracle(gate_row, up_row, activation), weight)


@pytest.mark.parametrize("form,dtype,shape", grid(["fused", "apart"], [mx.bfloat16, mx.float32], gpu_shapes(
    [(40, 256), (12, 8192)], [(2048, 8192)])))
def test_the_fused_glu_over_q4_weights_matches_the_ops_it_replaces(form, dtype, shape, gpu_kernels):
    out_features, width = shape
    weight = quantized(out_features, width, 64, dtype, width)
    gate, up, gate_row, up_row = gate_and_up(width, form, dtype, out_features)
    assert gemv.glu_available(gate, up, width, "silu", weight)
    got = gemv.glu_gemv(gate, up, width, "silu", weight)
    assert_close(got, glu_row_oracle(gate_row, up_row, "silu"), dequantized(weight))


def test_only_glu_rows_the_kernel_can_build_are_taken(monkeypatch, kernels_on):
    # As on a GPU wherever this runs: then only the operands decide.
    monkeypatch.setattr(gemv, "_ON_CUDA", True)
    monkeypatch.setattr(gemv.mx, "default_device", lambda: mx.gpu)
    weight = mx.ones((32, 64), mx.bfloat16)
    row = lambda *shape, dtype=mx.bfloat16: mx.ones(shape, dtype)  # noqa: E731
    assert gemv.glu_available(row(1, 1, 64), row(1, 1, 64), 64, "silu", weight)
    assert gemv.glu_available(row(1, 1, 144), None, 64, "gelu_tanh", weight)  # fused, 16 padding
    assert not gemv.glu_available(row(1, 1, 100), None, 64, "silu", weight)  # halves overlap
    assert not gemv.glu_available(row(1, 2, 64), row(1, 2, 64), 64, "silu", weight)  # two rows
    assert not gemv.glu_available(row(1, 1, 64), row(1, 1, 64, dtype=mx.float32), 64, "silu", weight)
    assert not gemv.glu_available(row(1, 1, 64), row(1, 1, 64), 64, "relu", weight)  # no such activation
    assert not gemv.glu_available(row(1, 1, 32), row(1, 1, 32), 32, "silu", weight)  # lengths differ
    big = gemv.STAGED_BYTES // 2 + 8  # bfloat16 features past the block's shared memory
    assert not gemv.glu_available(row(1, 1, big), row(1, 1, big), big, "silu", mx.ones((4, big), mx.bfloat16))
    monkeypatch.setattr(gemv, "glu_enabled", False)
    assert not gemv.glu_available(row(1, 1, 64), row(1, 1, 64), 64, "silu", weight)


@pytest.mark.parametrize("op,form", [("glu_linear", "fused"), ("glu_linear", "apart"),
                                     ("glu_quantized_linear", "fused")])
def test_the_glu_handlers_take_the_kernel_for_one_row(op, form, monkeypatch, gpu_kernels):
    width, out_features = 256, 384
    rng = np.random.default_rng(9)
    bias = stored(rng.standard_normal((out_features,)), mx.bfloat16)
    packed = quantized(out_features, width, 64, mx.bfloat16, 9)
    dense = dequantized(packed).astype(mx.bfloat16)
    gate, up, gate_row, up_row = gate_and_up(width, form, mx.bfloat16, 10)
    attrs = {"activation": "silu", **({"width": width} if up is None else {})}
    if op == "glu_quantized_linear":
        args, weight = [gate, up, packed.weight, packed.scales, packed.biases, bias], dequantized(packed)
        attrs.update(mode="affine", bits=4, group_size=64)
    else:
        args, weight = [gate, up, dense, bias], dense
    calls = []
    kernel = gemv.glu_gemv
    monkeypatch.setattr(gemv, "glu_gemv", lambda *a, **k: calls.append(a) or kernel(*a, **k))
    got = HANDLERS[op](args, attrs, RunContext())
    assert len(calls) == 1
    # The oracle: MLX's own glu (silu in float32) and the weight's values, in float64.
    glued = (mx.sigmoid(gate_row.astype(mx.float32)) * gate_row.astype(mx.float32)).astype(mx.bfloat16) * up_row
    want = oracle(glued, weight) + np.array(bias.astype(mx.float32), dtype=np.float64)
    scale = max(float(np.abs(want).max()), 1.0)
    assert float(np.abs(np.array(got.astype(mx.float32), dtype=np.float64) - want).max()) <= 2e-2 * scale


@emulated
def test_the_glu_row_is_read_16_bytes_a_load_where_the_layout_allows(gpu_kernels):
    weight = mx.ones((8, 256), mx.bfloat16)
    loads = {}
    for form in FORMS:
        gate, up, _, _ = gate_and_up(256, form, mx.bfloat16, 13)
        mx.eval(gemv.glu_gemv(gate, up, 256, "silu", weight))
        loads[form] = cuda_emulation.last_launch.chunk_loads
    # The dot loop reads the staged row and the weight alike in every form; reading gate and
    # up by chunks adds 2 * 256 / 8 loads for each of the launch's blocks.
    blocks = -(-8 // gemv.tiling.rows_per_block)
    assert loads["fused"] - loads["fused_odd"] == loads["apart"] - loads["strided"] == blocks * 2 * 256 // 8
    assert loads["fused_odd"] == loads["strided"] > 0
