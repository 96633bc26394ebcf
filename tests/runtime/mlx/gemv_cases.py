"""What the CUDA GEMV kernels' tests (``test_gemv.py``, ``test_glu_gemv.py``) share: the
parameter grids, the float64 oracle and its tolerance, 4-bit weights packed by MLX, and the
fixtures that switch the kernels on (here, not in a conftest: on the GPU the tests run with
``--noconftest``, since the suite's conftest needs the exporter)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.runtime.mlx import gemv
from tests.runtime.mlx import cuda_emulation

ON_CUDA = mx.cuda.is_available() and mx.default_device() == mx.gpu
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="the kernel runs on CUDA only")
emulated = pytest.mark.skipif(ON_CUDA or not cuda_emulation.available(), reason="checks the CPU emulation")
DTYPES = list(gemv.DTYPES)
# Hypothesis examples: each is a kernel compiled anew (its shape is a template constant).
EXAMPLES = 25 if ON_CUDA else 6


def gpu_shapes(small: list, large: list) -> list:
    """Shapes of a case: the model's (large) too where the kernels run on a GPU."""
    return small + (large if ON_CUDA else [])


def grid(*axes: list) -> list:
    """Every combination of the axes' values, as parameters: those covering each value once,
    and the rest marked slow."""
    covering = {tuple(j % len(axis) for axis in axes) for j in range(max(map(len, axes)))}
    params = []
    for picks in itertools.product(*(range(len(axis)) for axis in axes)):
        values = [axis[i] for axis, i in zip(axes, picks)]
        params.append(pytest.param(*values, marks=[] if picks in covering else [pytest.mark.slow],
                                   id="-".join(str(v).replace("mlx.core.", "") for v in values)))
    return params


# Relative to the largest |y|: float32 accumulates in a different order than numpy; the
# half types also round the result to their 8 or 11 mantissa bits.
TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}
# The default, then a split one (each row's loads shared by 4 warps, 2 rows a group), so the
# fused rows' tests, which take the first two, cover both ways of summing a row.
TILINGS = [gemv.Tiling(8, 1, 4), gemv.Tiling(8, 2, 2, 4), gemv.Tiling(4, 2, 4), gemv.Tiling(8, 1, 8),
           gemv.Tiling(16, 1, 4, 2)]


def stored(values: np.ndarray, dtype: mx.Dtype) -> mx.array:
    """numpy values as an operand of ``dtype``: rounded to float32, then by MLX to dtype."""
    return mx.array(np.asarray(values, dtype=np.float32)).astype(dtype)


def oracle(x: mx.array, weight: mx.array) -> np.ndarray:
    """x @ weight.T in float64, from the values as stored."""
    as64 = lambda a: np.array(a.astype(mx.float32), dtype=np.float64)  # noqa: E731
    return as64(x) @ as64(weight).T


def assert_close(got: mx.array, x: mx.array, weight: mx.array) -> None:
    want = oracle(x, weight)
    assert got.shape == want.shape and got.dtype == x.dtype
    scale = max(float(np.abs(want).max()), 1.0)
    error = float(np.abs(np.array(got.astype(mx.float32), dtype=np.float64) - want).max())
    assert error <= TOLERANCE[x.dtype] * scale, (error, scale)


def quantized(out_features: int, in_features: int, group_size: int, dtype: mx.Dtype, seed: int) -> gemv.Packed4:
    """A random weight packed by MLX's own mx.quantize (affine, 4 bits)."""
    rng = np.random.default_rng(seed)
    weight = mx.array((rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)).astype(np.float32))
    packed, scales, biases = mx.quantize(weight.astype(dtype), group_size=group_size, bits=4)
    return gemv.Packed4(packed, scales, biases, group_size)


def dequantized(weight: gemv.Packed4) -> mx.array:
    """The oracle's weight: MLX's own mx.dequantize, in float32 (no rounding of scale * v + bias)."""
    return mx.dequantize(weight.weight, weight.scales.astype(mx.float32), weight.biases.astype(mx.float32),
                         group_size=weight.group_size, bits=4)


@pytest.fixture
def kernels_on(monkeypatch):
    """The kernels switched on, as MLX_PTE_GEMV=1 does."""
    monkeypatch.setattr(gemv, "enabled", True)


@pytest.fixture
def gpu_kernels(monkeypatch, kernels_on):
    """The kernels on and running: on CUDA, or in the CPU emulation (as if on a GPU)."""
    if ON_CUDA:
        return
    if not cuda_emulation.available():
        pytest.skip("no GPU, and no C++ compiler for the CUDA emulation")
    monkeypatch.setattr(gemv, "_ON_CUDA", True)
    monkeypatch.setattr(gemv.mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(gemv.mx.fast, "cuda_kernel", cuda_emulation.cuda_kernel)
    monkeypatch.setattr(gemv, "_kernels", {})
