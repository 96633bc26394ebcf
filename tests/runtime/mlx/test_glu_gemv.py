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
from mlx_pte.runtime.mlx import gemv, gemv_source
from tests.runtime.mlx.gemv_cases import (DTYPES, TILINGS, assert_close, dequantized, gpu_shapes, grid, oracle,
                                          quantized)
from tests.runtime.mlx.gemv_cases import gpu_kernels, kernels_on  # noqa: F401  (fixtures)

ACTIVATIONS = list(gemv_source.GLU_ACTIVATIONS)
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
    rounded = mx.array(act.astype(np.float32)).astype(gate.dtype)
    return (rounded.astype(mx.float32) * up.astype(mx.float32)).astype(gate.dtype)


def gate_and_up(width: int, fused: bool, dtype: mx.Dtype, seed: int) -> tuple[mx.array, mx.array | None, mx.array,
                                                                                mx.array]:
    """(the kernel's gate and up operands, the gate and up rows they hold): one fused row of
    both halves with 16 features of padding between, up None; or two rows."""
    rng = np.random.default_rng(seed)
    cast = lambda a: mx.array(a.astype(np.float32)).astype(dtype)  # noqa: E731
    if fused:
        both = cast(rng.standard_normal((1, 1, 2 * width + 16)) * 2)
        return both, None, both[..., :width], both[..., -width:]
    gate, up = cast(rng.standard_normal((1, 1, width)) * 2), cast(rng.standard_normal((1, 1, width)))
    return gate, up, gate, up


@pytest.mark.parametrize("activation,fused,tiling,dtype,shape", grid(ACTIVATIONS, [True, False], TILINGS[:2], DTYPES,
                                                                      gpu_shapes([(37, 264), (9, 100), (24, 8192)],
                                                                                 [(2048, 8192)])))
def test_the_fused_glu_matches_the_ops_it_replaces(activation, fused, tiling, dtype, shape, gpu_kernels):
    out_features, width = shape
    rng = np.random.default_rng(out_features + width)
    weight = mx.array((rng.standard_normal((out_features, width)) / np.sqrt(width)).astype(np.float32)).astype(dtype)
    gate, up, gate_row, up_row = gate_and_up(width, fused, dtype, width)
    assert gemv.glu_available(gate, up, width, activation, weight)
    got = gemv.glu_gemv(gate, up, width, activation, weight, layout=tiling)
    assert_close(got, glu_row_oracle(gate_row, up_row, activation), weight)


@pytest.mark.parametrize("fused,dtype,shape", grid([True, False], [mx.bfloat16, mx.float32], gpu_shapes(
    [(40, 256), (12, 8192)], [(2048, 8192)])))
def test_the_fused_glu_over_q4_weights_matches_the_ops_it_replaces(fused, dtype, shape, gpu_kernels):
    out_features, width = shape
    weight = quantized(out_features, width, 64, dtype, width)
    gate, up, gate_row, up_row = gate_and_up(width, fused, dtype, out_features)
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


@pytest.mark.parametrize("op,fused", [("glu_linear", True), ("glu_linear", False), ("glu_quantized_linear", True)])
def test_the_glu_handlers_take_the_kernel_for_one_row(op, fused, monkeypatch, gpu_kernels):
    width, out_features = 256, 384
    rng = np.random.default_rng(9)
    bias = mx.array(rng.standard_normal((out_features,)).astype(np.float32)).astype(mx.bfloat16)
    packed = quantized(out_features, width, 64, mx.bfloat16, 9)
    dense = dequantized(packed).astype(mx.bfloat16)
    gate, up, gate_row, up_row = gate_and_up(width, fused, mx.bfloat16, 10)
    attrs = {"activation": "silu", **({"width": width} if fused else {})}
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
