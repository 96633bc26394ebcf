"""The CUDA GEMV kernel (``runtime/mlx/gemv.py``) and the linear that takes it.

The kernels' cases compare them with a float64 product in numpy (MLX's own dequantize for
4-bit weights, MLX's casts for the norm's rounding) over the tilings the bench sweeps, each
dtype, row lengths that do and do not fill a 16-byte load, and weights that are strided
views (a transposed or sliced weight takes the strided loop). On CUDA (``bench/gpu_suite.sh``
step ``gpu_tests``) the kernels run there, at the model's shapes too; elsewhere they run in
``cuda_emulation`` (the same sources on CPU threads, 16-byte loads checked for alignment).
Either way the combinations that cover each tiling, dtype and shape once are the default
run, every combination the slow one (``-m slow``): each case compiles its kernel anew, about
2.5 s on a GPU host, so all of them would outlast one device call. Everywhere, the cases
check which linears hand them their rows.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.interpreter.handlers import HANDLERS, RunContext
from mlx_pte.runtime.mlx import gemv, gemv_source
from tests.runtime.mlx import cuda_emulation
from tests.runtime.mlx.gemv_cases import (DTYPES, EXAMPLES, TILINGS, assert_close, cuda_only, dequantized, emulated,
                                          gpu_shapes, grid, oracle, quantized, stored)
from tests.runtime.mlx.gemv_cases import gpu_kernels, kernels_on  # noqa: F401  (fixtures)


def test_the_kernel_stays_off_the_cpu(kernels_on):
    x, weight = mx.ones((1, 1, 64)), mx.ones((32, 64))
    with mx.stream(mx.cpu):
        assert not gemv.available(x, weight)


def test_the_kernels_are_off_unless_asked_for(monkeypatch):
    import importlib

    monkeypatch.setattr(gemv, "enabled", gemv.enabled)  # put back after the reloads
    for value, on in ((None, False), ("0", False), ("1", True)):
        if value is None:
            monkeypatch.delenv("MLX_PTE_GEMV", raising=False)
        else:
            monkeypatch.setenv("MLX_PTE_GEMV", value)
        assert importlib.reload(gemv).enabled is on


def test_a_tiling_the_kernel_cannot_take_is_refused_when_made():
    assert gemv.Tiling.parse("16x1x4x4") == gemv.Tiling(16, 1, 4, 4)
    assert gemv.Tiling.parse("4x2x8").split == 1
    for warps, rows, unroll, split in ((8, 1, 4, 3), (64, 1, 4, 1), (8, 0, 4, 1), (0, 1, 4, 1)):
        with pytest.raises(ValueError, match="a tiling needs"):
            gemv.Tiling(warps, rows, unroll, split)
    for text in ("8x1", "8x1x4x2x1", "eightx1x4"):
        with pytest.raises(ValueError, match="WARPSxROWSxUNROLL"):
            gemv.Tiling.parse(text)


def test_a_row_kind_the_kernels_do_not_build_is_refused():
    with pytest.raises(ValueError, match="a GEMV row is one of input, norm, add_norm"):
        gemv_source.kernel_source(False, "relu_norm")


def test_only_one_row_of_a_matching_dtype_is_taken(monkeypatch, kernels_on):
    # As on a GPU wherever this runs: then only the operands decide.
    monkeypatch.setattr(gemv, "_ON_CUDA", True)
    monkeypatch.setattr(gemv.mx, "default_device", lambda: mx.gpu)
    weight = mx.ones((32, 64), mx.bfloat16)
    assert gemv.available(mx.ones((1, 1, 64), mx.bfloat16), weight)
    assert gemv.available(mx.ones((64,), mx.bfloat16), weight)
    assert not gemv.available(mx.ones((1, 2, 64), mx.bfloat16), weight)  # two rows: a GEMM
    assert not gemv.available(mx.ones((1, 1, 64), mx.float32), weight)  # mixed dtypes
    assert not gemv.available(mx.ones((1, 1, 64), mx.int32), mx.ones((32, 64), mx.int32))
    assert not gemv.available(mx.ones((1, 1, 64), mx.bfloat16), mx.ones((2, 32, 64), mx.bfloat16))
    assert not gemv.available(mx.ones((1, 1, 32), mx.bfloat16), weight)  # lengths differ
    monkeypatch.setattr(gemv, "enabled", False)
    assert not gemv.available(mx.ones((1, 1, 64), mx.bfloat16), weight)


@pytest.mark.parametrize("tiling,dtype,shape", grid(TILINGS, DTYPES, gpu_shapes(
    [(37, 264), (5, 8), (9, 100), (40, 2048)], [(3072, 2048), (2048, 8192)])))
def test_kernel_matches_float64(tiling, dtype, shape, gpu_kernels):
    out_features, in_features = shape
    key = mx.random.key(out_features * 7 + in_features)
    kx, kw = mx.random.split(key)
    x = mx.random.normal((1, 1, in_features), key=kx).astype(dtype)
    weight = mx.random.normal((out_features, in_features), key=kw).astype(dtype)
    assert_close(gemv.gemv(x, weight, tiling), x, weight)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(out_features=st.integers(1, 300), in_features=st.integers(1, 600), form=st.sampled_from(
    ["contiguous", "transposed", "column_slice", "row_slice", "strided_x"]),
    tiling=st.sampled_from(TILINGS), dtype=st.sampled_from([mx.bfloat16, mx.float32]))
def test_strided_weights_and_rows_match_float64(out_features, in_features, form, tiling, dtype, gpu_kernels):
    rng = np.random.default_rng(out_features * 1000 + in_features)
    base = stored(rng.standard_normal((out_features + 3, in_features + 5)), dtype)
    x = stored(rng.standard_normal((1, in_features)), dtype)
    weight = {
        "contiguous": base[:out_features, :in_features],
        "transposed": stored(rng.standard_normal((in_features, out_features)), dtype).T,
        "column_slice": base[:out_features, 5:],  # rows start 5 elements in: no 16-byte loads
        "row_slice": base[3:, :in_features],
        "strided_x": base[:out_features, :in_features],
    }[form]
    if form == "strided_x":
        x = stored(rng.standard_normal((1, 2 * in_features)), dtype)[:, ::2]
    assert_close(gemv.gemv(x, weight, tiling), x, weight)


@pytest.mark.parametrize("bias", [False, True])
def test_the_linear_handler_takes_the_kernel_for_one_row(bias, monkeypatch, gpu_kernels):
    rng = np.random.default_rng(3)
    x = stored(rng.standard_normal((1, 1, 256)), mx.bfloat16)
    weight = stored(rng.standard_normal((384, 256)), mx.bfloat16)
    b = stored(rng.standard_normal((384,)), mx.bfloat16) if bias else None
    calls = []
    kernel = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a, **k: calls.append(a) or kernel(*a, **k))
    got = HANDLERS["linear"]([x, weight, b], {}, RunContext())
    assert len(calls) == 1
    want = oracle(x, weight) + (0 if b is None else np.array(b.astype(mx.float32), dtype=np.float64))
    scale = max(float(np.abs(want).max()), 1.0)
    assert float(np.abs(np.array(got.astype(mx.float32), dtype=np.float64) - want).max()) <= 2e-2 * scale


@cuda_only
def test_the_kernel_runs_inside_a_compiled_function():
    # Captured segments are mx.compile'd: the kernel is traced once and replayed after.
    rng = np.random.default_rng(5)
    weight = stored(rng.standard_normal((640, 512)), mx.bfloat16)
    step = mx.compile(lambda x, w: mx.fast.rms_norm(gemv.gemv(x, w), None, 1e-5) * 2)
    for seed in range(3):  # the first call traces, the others replay
        x = stored(np.random.default_rng(seed).standard_normal((1, 1, 512)), mx.bfloat16)
        want = mx.fast.rms_norm(mx.array(oracle(x, weight).astype(np.float32)), None, 1e-5) * 2
        got = step(x, weight).astype(mx.float32)
        assert float(mx.max(mx.abs(got - want)).item()) <= 5e-2


def rms_norm_oracle(h: np.ndarray, weight: mx.array, eps: float, dtype: mx.Dtype) -> mx.array:
    """rms_norm by the catalog's rule: normalized in float64 here, rounded to the dtype,
    times the weight, rounded again (MLX's casts do the rounding)."""
    unit = h / np.sqrt(np.mean(h**2) + eps)
    rounded = stored(unit, dtype)
    return (rounded.astype(mx.float32) * weight.astype(mx.float32)).astype(dtype)


@pytest.mark.parametrize("residual,tiling,dtype,shape", grid([False, True], TILINGS[:2], DTYPES, gpu_shapes(
    [(37, 264), (9, 100), (24, 8192)], [(3072, 2048), (512, 8192)])))
def test_the_fused_norm_matches_the_ops_it_replaces(residual, tiling, dtype, shape, gpu_kernels):
    out_features, in_features = shape
    rng = np.random.default_rng(out_features + in_features)
    weight = mx.array((rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)).astype(np.float32))
    dense = weight.astype(dtype)
    assert_fused_norm_matches(residual, dtype, dense, dense, tiling)


# How the norm's operands reach the kernel: whole rows (16-byte loads), the row and residual
# as strided views, each starting 3 elements into a buffer (not on 16 bytes), or the norm
# weight a strided view; the last three take the one-element loops.
NORM_FORMS = ["contiguous", "strided", "offset", "strided_weight"]


def norm_operands(form: str, residual: bool, in_features: int, dtype: mx.Dtype,
                  rng: np.random.Generator) -> tuple[mx.array, mx.array | None, mx.array]:
    """(x, the residual or None, the norm weight) laid out as ``form`` says."""
    cast = lambda a: stored(a, dtype)  # noqa: E731
    step, start = (2, 0) if form == "strided" else (1, 3) if form == "offset" else (1, 0)

    def row(scale: float) -> mx.array:
        whole = cast(rng.standard_normal((1, 1, start + step * in_features)) * scale)
        return whole[..., start::step]

    x = row(3)
    other = row(1) if residual else None
    weight_step = 2 if form == "strided_weight" else 1
    norm_weight = cast(1 + 0.1 * rng.standard_normal(weight_step * in_features))[::weight_step]
    return x, other, norm_weight


def assert_fused_norm_matches(residual: bool, dtype: mx.Dtype, weight: gemv.Weight, dense: mx.array,
                              tiling: gemv.Tiling | None = None, form: str = "contiguous") -> None:
    """norm_gemv against rms_norm_oracle (of x + a residual, or of x) times ``dense`` (the
    weight's values), and its sum output against MLX's add rounded to the dtype."""
    in_features = dense.shape[1]
    x, other, norm_weight = norm_operands(form, residual, in_features, dtype, np.random.default_rng(in_features))
    assert gemv.norm_available(x, norm_weight, weight, other)
    got, total = gemv.norm_gemv(x, norm_weight, 1e-5, weight, residual=other, layout=tiling)
    h = x if other is None else (x.astype(mx.float32) + other.astype(mx.float32)).astype(dtype)
    assert np.array_equal(np.array(total.astype(mx.float32)), np.array(h.astype(mx.float32)))
    normed = rms_norm_oracle(np.array(h.astype(mx.float32), dtype=np.float64), norm_weight, 1e-5, dtype)
    assert_close(got, normed, dense)


@pytest.mark.parametrize("residual,form", grid([False, True], NORM_FORMS))
def test_the_fused_norm_reads_its_operands_in_any_layout(residual, form, gpu_kernels):
    rng = np.random.default_rng(14)
    weight = stored(rng.standard_normal((24, 264)) / 16, mx.bfloat16)
    assert_fused_norm_matches(residual, mx.bfloat16, weight, weight, form=form)


@emulated
@pytest.mark.parametrize("residual", [False, True])
def test_the_norm_row_is_read_16_bytes_a_load_where_the_layout_allows(residual, gpu_kernels):
    weight = mx.ones((8, 256), mx.bfloat16)
    loads = {}
    for form in NORM_FORMS:
        x, other, norm_weight = norm_operands(form, residual, 256, mx.bfloat16, np.random.default_rng(15))
        mx.eval(gemv.norm_gemv(x, norm_weight, 1e-5, weight, residual=other))
        loads[form] = cuda_emulation.last_launch.chunk_loads
    # The dot loop reads the staged row and the weight alike in every form. The first pass
    # reads x (and the residual) by chunks where both allow it; the second, the norm weight
    # and the staged row, where the norm weight does. bfloat16: 256 features are 32 chunks,
    # read by each of the blocks.
    blocks, chunks = -(-8 // gemv.tiling.rows_per_block), 256 // 8
    assert loads["contiguous"] - loads["offset"] == blocks * (2 if residual else 1) * chunks
    assert loads["contiguous"] - loads["strided_weight"] == blocks * 2 * chunks
    assert loads["offset"] == loads["strided"]


# -- 4-bit affine weights (gemv.Packed4) ---------------------------------------------------
def test_packed_weights_fit_the_kernel_by_their_parts():
    weight = quantized(8, 128, 64, mx.bfloat16, 0)
    assert weight.shape == (8, 128) and weight.fits(mx.bfloat16)
    assert not weight.fits(mx.float16)  # scales of another dtype than the row
    # Scales for groups of 64 read as groups of 32: too few.
    assert not gemv.Packed4(weight.weight, weight.scales, weight.biases, 32).fits(mx.bfloat16)
    packed, scales, biases = mx.quantize(mx.ones((8, 128)), group_size=128, bits=8)
    assert not gemv.Packed4(packed, scales, biases, 128).fits(mx.float32)  # 8-bit words: 4 values each


def test_only_4_bit_affine_weights_reach_the_kernel(monkeypatch, kernels_on):
    from mlx_pte.interpreter.handlers import _packed4

    weight = quantized(8, 128, 64, mx.float32, 0)
    parts = [weight.weight, weight.scales, weight.biases, None]
    assert _packed4(parts, {"mode": "affine", "bits": 4, "group_size": 64}) is not None
    assert _packed4(parts, {"mode": "affine", "bits": 8, "group_size": 64}) is None
    assert _packed4([*parts[:2], None, None], {"mode": "mxfp4", "bits": 4, "group_size": 32}) is None


@pytest.mark.parametrize("tiling,dtype,shape", grid(TILINGS, DTYPES, gpu_shapes(
    [(40, 256, 32), (9, 384, 128), (5, 32, 32), (24, 2048, 64)], [(3072, 2048, 64), (2048, 8192, 64)])))
def test_q4_kernel_matches_dequantized_float64(tiling, dtype, shape, gpu_kernels):
    out_features, in_features, group_size = shape
    weight = quantized(out_features, in_features, group_size, dtype, out_features + in_features)
    x = stored(np.random.default_rng(in_features).standard_normal((1, 1, in_features)), dtype)
    assert gemv.available(x, weight)
    assert_close(gemv.gemv(x, weight, tiling), x, dequantized(weight))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(out_features=st.integers(1, 200), groups=st.integers(1, 12), group_size=st.sampled_from([32, 64, 128]),
       form=st.sampled_from(["contiguous", "row_slice", "strided_x"]), tiling=st.sampled_from(TILINGS))
def test_q4_row_slices_and_strided_rows_match_float64(out_features, groups, group_size, form, tiling, gpu_kernels):
    # A strided row takes the kernel's scalar loop; a slice of rows keeps the 16-byte loads.
    in_features = groups * group_size
    weight = quantized(out_features + 3, in_features, group_size, mx.bfloat16, out_features * 100 + groups)
    if form == "row_slice":
        weight = gemv.Packed4(weight.weight[3:], weight.scales[3:], weight.biases[3:], group_size)
    rng = np.random.default_rng(groups)
    x = stored(rng.standard_normal((1, 2 * in_features)), mx.bfloat16)
    x = x[:, ::2] if form == "strided_x" else x[:, :in_features]
    assert_close(gemv.gemv(x, weight, tiling), x, dequantized(weight))


@pytest.mark.parametrize("residual,dtype,shape", grid([False, True], [mx.bfloat16, mx.float32], gpu_shapes(
    [(40, 256), (12, 8192)], [(3072, 2048), (512, 8192)])))
def test_the_fused_norm_over_q4_weights_matches_the_ops_it_replaces(residual, dtype, shape, gpu_kernels):
    weight = quantized(*shape, 64, dtype, shape[1])
    assert_fused_norm_matches(residual, dtype, weight, dequantized(weight))


@pytest.mark.parametrize("op", ["quantized_linear", "rms_norm_quantized_linear", "add_rms_norm_quantized_linear"])
def test_the_quantized_handlers_take_the_kernel_for_one_row(op, monkeypatch, gpu_kernels):
    rng = np.random.default_rng(7)
    weight = quantized(384, 256, 64, mx.bfloat16, 7)
    row = lambda: stored(rng.standard_normal((1, 1, 256)), mx.bfloat16)  # noqa: E731
    x, other, norm_weight = row(), row(), mx.ones((256,), mx.bfloat16)
    bias = stored(rng.standard_normal((384,)), mx.bfloat16)
    parts = [weight.weight, weight.scales, weight.biases, bias]
    attrs = {"mode": "affine", "bits": 4, "group_size": 64, "eps": 1e-5}
    calls = []
    for name in ("gemv", "norm_gemv"):
        kernel = getattr(gemv, name)
        monkeypatch.setattr(gemv, name, lambda *a, k=kernel, **kw: calls.append(a) or k(*a, **kw))
    args = {"quantized_linear": [x, *parts], "rms_norm_quantized_linear": [x, norm_weight, *parts],
            "add_rms_norm_quantized_linear": [x, other, norm_weight, *parts]}[op]
    got = HANDLERS[op](args, attrs, RunContext())
    got = got[0] if isinstance(got, tuple) else got
    assert len(calls) == 1
    # The oracle: MLX's own ops on the dequantized weight, the norm where the op has one.
    h = x + other if op.startswith("add") else x
    normed = h if op == "quantized_linear" else mx.fast.rms_norm(h, norm_weight, 1e-5)
    want = oracle(normed, dequantized(weight)) + np.array(bias.astype(mx.float32), dtype=np.float64)
    scale = max(float(np.abs(want).max()), 1.0)
    assert float(np.abs(np.array(got.astype(mx.float32), dtype=np.float64) - want).max()) <= 2e-2 * scale


# -- the CPU emulation's own checks ------------------------------------------------------------


@emulated
@pytest.mark.parametrize("form,loads", [
    ("contiguous", True), ("row_slice", True), ("aligned_column_slice", True), ("transposed", False),
    ("column_slice", False), ("strided_x", False), ("odd_length", False)])
def test_the_16_byte_loads_are_taken_where_the_layout_allows(form, loads, gpu_kernels):
    # bfloat16: 8 elements a load. A slice keeps the loads where its rows start on 16 bytes.
    rng = np.random.default_rng(11)
    cast = lambda a: stored(a, mx.bfloat16)  # noqa: E731
    in_features = 100 if form == "odd_length" else 256
    x = cast(rng.standard_normal((1, 2 * in_features)))
    x = x[:, ::2] if form == "strided_x" else x[:, :in_features]
    weight = {
        "row_slice": lambda: cast(rng.standard_normal((30, in_features)))[6:],
        "aligned_column_slice": lambda: cast(rng.standard_normal((24, in_features + 16)))[:, 8:in_features + 8],
        "column_slice": lambda: cast(rng.standard_normal((24, in_features + 16)))[:, 5:in_features + 5],
        "transposed": lambda: cast(rng.standard_normal((in_features, 24))).T,
    }.get(form, lambda: cast(rng.standard_normal((24, in_features))))()
    assert_close(gemv.gemv(x, weight), x, weight)
    assert (cuda_emulation.last_launch.chunk_loads > 0) is loads


@emulated
@pytest.mark.parametrize("form,loads", [("contiguous", True), ("row_slice", True), ("strided_x", False)])
def test_the_q4_kernel_loads_16_bytes_where_the_layout_allows(form, loads, gpu_kernels):
    weight = quantized(30, 256, 64, mx.bfloat16, 12)
    if form == "row_slice":
        weight = gemv.Packed4(weight.weight[6:], weight.scales[6:], weight.biases[6:], 64)
    x = stored(np.random.default_rng(12).standard_normal((1, 512)), mx.bfloat16)
    x = x[:, ::2] if form == "strided_x" else x[:, :256]
    assert_close(gemv.gemv(x, weight), x, dequantized(weight))
    assert (cuda_emulation.last_launch.chunk_loads > 0) is loads


@emulated
def test_the_emulation_refuses_a_16_byte_load_the_gpu_would_fault_on():
    kernel = cuda_emulation.cuda_kernel("misaligned", ["x"], ["y"], source="""
        const PteChunk chunk = reinterpret_cast<const PteChunk*>(x + START)[0];
        y[threadIdx.x] = reinterpret_cast<const T*>(&chunk)[threadIdx.x % 4];
    """, header=gemv_source.HEADER, ensure_row_contiguous=False)
    x = mx.arange(64, dtype=mx.float32)

    def load(start: int) -> mx.array:
        return kernel(inputs=[x], template=[("T", mx.float32), ("START", start)], grid=(32, 1, 1),
                      threadgroup=(32, 1, 1), output_shapes=[(32,)], output_dtypes=[mx.float32])[0]

    assert load(4).tolist() == [4.0 + i % 4 for i in range(32)]  # 16 bytes in: aligned
    with pytest.raises(cuda_emulation.MisalignedLoad):
        load(1)
