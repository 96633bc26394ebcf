"""One row times a weight, ``x @ weight.T``, in one CUDA kernel built for bandwidth.

At batch 1 a decode step is mostly GEMVs (on Llama-3.2-1B, 65 a token and two thirds of
the step's kernel time), each reading a whole weight once, so their speed is the memory
bandwidth they reach. MLX's ``gemv_single`` has each lane load 4 elements (8 bytes of
bf16) per iteration of a loop whose bound is a run-time value; this kernel has each lane
load 16 bytes per load, with the row length a compile-time constant so the loop unrolls
and several loads per lane are in flight at once.

The same kernel may first build its row: ``norm_gemv`` normalizes it (after a residual add)
in shared memory, so a decoder layer's add, norm and projection are one kernel
(``ir/norm_linears.py`` makes them one op at load). The kernels are off unless
``MLX_PTE_GEMV=1`` (see ``enabled``).

Layout: ``WARPS`` warps per block, each warp computing ``ROWS`` consecutive output rows;
a lane reads every 32nd 16-byte chunk of its rows and of x, accumulates in float, and the
warp sums its lanes by shuffles. Strides are read from the arrays, so no input is copied:
rows whose stride, alignment or inner stride rule out 16-byte loads take a strided loop
(the branch is uniform over the whole grid).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Callable, Optional

from mlx_pte.runtime.mlx.bootstrap import mx

# Sets ``x`` (the row, T*) and ``x_stride`` for the dot product below: the input as given.
_ROW_FROM_INPUT = """
    const long long x_stride = x_strides[x_ndim - 1];
"""

# Sets them to the row normalized in shared memory: every block normalizes the whole row
# itself (a few KB read from L2), so the norm, and the residual add before it, cost no
# kernel of their own. Rounding follows ``rms_norm``'s catalog rule: the sum rounded to T,
# x * rsqrt(mean(x**2) + eps) in float rounded to T, times the weight rounded to T.
# {sum_row} / {write_sum} read the residual and write the sum (block 0), or not.
_ROW_FROM_NORM = """
    __shared__ PteChunk staged[(IN * sizeof(T) + 15) / 16];  // 16-byte aligned for the loads below
    __shared__ float partial[WARPS];
    T* normed = reinterpret_cast<T*>(staged);
    const long long a_step = a_strides[a_ndim - 1];
    const long long g_step = g_strides[g_ndim - 1];
    float squares = 0.0f;
    for (int i = threadIdx.x; i < IN; i += WARPS * 32) {{
        const T h = {sum_row};
        {write_sum}
        const float hf = static_cast<float>(h);
        squares += hf * hf;
        normed[i] = h;
    }}
    #pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {{
        squares += __shfl_xor_sync(0xffffffff, squares, offset);
    }}
    if (threadIdx.x % 32 == 0) {{
        partial[threadIdx.x / 32] = squares;
    }}
    __syncthreads();
    float total = 0.0f;
    #pragma unroll
    for (int w = 0; w < WARPS; ++w) {{
        total += partial[w];
    }}
    const float scale = rsqrtf(total / IN + __int_as_float(EPS));
    for (int i = threadIdx.x; i < IN; i += WARPS * 32) {{
        const T unit = static_cast<T>(static_cast<float>(normed[i]) * scale);
        normed[i] = static_cast<T>(static_cast<float>(unit) * static_cast<float>(g[i * g_step]));
    }}
    __syncthreads();
    const T* x = normed;
    const long long x_stride = 1;
"""
_SUM_ROW = {
    False: ("a[i * a_step]", ""),
    True: ("static_cast<T>(static_cast<float>(a[i * a_step]) + static_cast<float>(b[i * b_strides[b_ndim - 1]]))",
           "if (blockIdx.x == 0) { total_row[i] = h; }"),
}

# The dot product of ROWS rows of w with x per warp, into y. After the row's set-up, which
# may synchronize the block: a warp with no rows leaves only here.
_DOT = """
    constexpr int VEC = 16 / sizeof(T);  // elements per 16-byte load
    constexpr int CHUNKS = IN / VEC;
    const int lane = threadIdx.x % 32;
    const int first = (blockIdx.x * WARPS + threadIdx.x / 32) * ROWS;
    if (first >= OUT) {
        return;
    }
    const long long row_stride = w_strides[0];
    const long long col_stride = w_strides[1];
    // Rows past OUT (a last warp's spare rows) read the last row again and are not written.
    const T* rows[ROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        rows[r] = w + (first + r < OUT ? first + r : OUT - 1) * row_stride;
    }
    float acc[ROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        acc[r] = 0.0f;
    }
    const bool vector = col_stride == 1 && x_stride == 1 && IN % VEC == 0 && row_stride % VEC == 0
        && (reinterpret_cast<size_t>(w) % 16) == 0 && (reinterpret_cast<size_t>(x) % 16) == 0;
    if (vector) {
        // UNROLL chunks of x and of each row are loaded before any is used, so a lane keeps
        // that many 16-byte loads per row in flight; chunks past the row's end load as zeros.
        constexpr int STEPS = (CHUNKS + 31) / 32;
        const PteChunk* xv = reinterpret_cast<const PteChunk*>(x);
        for (int step = 0; step < STEPS; step += UNROLL) {
            PteChunk xc[UNROLL];
            PteChunk wc[UNROLL][ROWS];
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int i = lane + (step + u) * 32;
                const bool inside = step + u < STEPS && i < CHUNKS;
                xc[u] = inside ? xv[i] : PteChunk{};
                #pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    wc[u][r] = inside ? reinterpret_cast<const PteChunk*>(rows[r])[i] : PteChunk{};
                }
            }
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const T* xs = reinterpret_cast<const T*>(&xc[u]);
                #pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    const T* ws = reinterpret_cast<const T*>(&wc[u][r]);
                    #pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        acc[r] += static_cast<float>(ws[j]) * static_cast<float>(xs[j]);
                    }
                }
            }
        }
    } else {
        for (int i = lane; i < IN; i += 32) {
            const float xi = static_cast<float>(x[i * x_stride]);
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                acc[r] += static_cast<float>(rows[r][i * col_stride]) * xi;
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        #pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) {
            acc[r] += __shfl_xor_sync(0xffffffff, acc[r], offset);
        }
    }
    if (lane == 0) {
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (first + r < OUT) {
                y[first + r] = static_cast<T>(acc[r]);
            }
        }
    }
"""

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# The fused norm stages the row in shared memory (48 KB a block, static).
STAGED_BYTES = 32 * 1024


@dataclass(frozen=True)
class Tiling:
    """How the kernel lays rows over the GPU: warps per block, rows per warp, and how many
    16-byte loads of a lane's loop the compiler unrolls (loads in flight per lane)."""

    warps: int = 8
    rows: int = 1
    unroll: int = 4


# Off unless MLX_PTE_GEMV=1: the kernels have not yet run on a GPU (their CUDA tests,
# tests/runtime/mlx/test_gemv.py, and the bench suite's gemv_forms step are what turn
# them on by default). The bench also switches them in-process (enabled: both kernels;
# norm_enabled: the fused norm only) to time MLX's ops in the same run.
enabled = os.environ.get("MLX_PTE_GEMV") == "1"
norm_enabled = True
tiling = Tiling()
# Asked once: the checks run on every linear of a traced step.
_ON_CUDA = mx.cuda.is_available()
# PteChunk: 16 bytes, loaded and stored whole (one 128-bit access), with no vector type needed.
_HEADER = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
struct alignas(16) PteChunk { unsigned int word[4]; };
"""
_kernels: dict[str, Callable] = {}


def _kernel(kind: str) -> Callable:
    """The kernel of ``kind``: "gemv", "norm" (rms_norm, then the gemv) or "add_norm" (a
    residual add, rms_norm of the sum, then the gemv; the sum is a second output)."""
    if kind not in _kernels:
        if kind == "gemv":
            inputs, outputs, source = ["w", "x"], ["y"], _ROW_FROM_INPUT + _DOT
        else:
            residual = kind == "add_norm"
            sum_row, write_sum = _SUM_ROW[residual]
            inputs = ["w", "a", "b", "g"] if residual else ["w", "a", "g"]
            outputs = ["y", "total_row"] if residual else ["y"]
            source = _ROW_FROM_NORM.format(sum_row=sum_row, write_sum=write_sum) + _DOT
        _kernels[kind] = mx.fast.cuda_kernel(name=f"mlx_pte_{kind}_gemv", input_names=inputs, output_names=outputs,
                                             source=source, header=_HEADER, ensure_row_contiguous=False)
    return _kernels[kind]


def available(x: mx.array, weight: mx.array) -> bool:
    """Whether ``gemv`` runs ``x @ weight.T`` on this process's default device: the kernels
    on, CUDA, one row of x (any leading axes of size 1), a 2-D weight of x's floating dtype."""
    return (
        enabled
        and _ON_CUDA
        and mx.default_device() == mx.gpu
        and x.ndim >= 1
        and x.size == x.shape[-1]
        and weight.ndim == 2
        and weight.shape[0] > 0
        and weight.shape[1] == x.shape[-1] > 0
        and x.dtype == weight.dtype
        and x.dtype in DTYPES
    )


def norm_available(x: mx.array, norm_weight: mx.array, weight: mx.array, residual: Optional[mx.array] = None) -> bool:
    """Whether ``norm_gemv`` runs these operands here: ``available``'s rules, a norm weight
    (and residual) of x's shape and dtype, and a row that fits the block's shared memory."""
    return (
        norm_enabled
        and available(x, weight)
        and x.shape[-1] * x.itemsize <= STAGED_BYTES
        and norm_weight.shape == (x.shape[-1],)
        and norm_weight.dtype == x.dtype
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype))
    )


def _call(kind: str, inputs: list[mx.array], weight: mx.array, extra: list, layout: Optional[Tiling],
          outputs: int = 1) -> list[mx.array]:
    """The ``kind`` kernel over ``weight`` and ``inputs`` (the row first)."""
    row = inputs[0]
    layout = layout or tiling
    out_features, in_features = weight.shape
    blocks = -(-out_features // (layout.warps * layout.rows))
    # Leading axes of the row are all 1, so the flat rows the kernel writes are this shape.
    shapes = [(*row.shape[:-1], out_features), row.shape][:outputs]
    return _kernel(kind)(
        inputs=[weight, *inputs],
        template=[("T", row.dtype), ("OUT", out_features), ("IN", in_features), ("WARPS", layout.warps),
                  ("ROWS", layout.rows), ("UNROLL", layout.unroll), *extra],
        grid=(blocks * 32 * layout.warps, 1, 1),
        threadgroup=(32 * layout.warps, 1, 1),
        output_shapes=shapes,
        output_dtypes=[row.dtype] * outputs,
    )


def gemv(x: mx.array, weight: mx.array, layout: Optional[Tiling] = None) -> mx.array:
    """``x @ weight.T`` for one row x ([..., in], leading axes of size 1) and weight
    [out, in]; the result has x's leading axes and ``out`` last, in x's dtype."""
    return _call("gemv", [x], weight, [], layout)[0]


def norm_gemv(x: mx.array, norm_weight: mx.array, eps: float, weight: mx.array,
              residual: Optional[mx.array] = None, layout: Optional[Tiling] = None) -> tuple[mx.array, mx.array]:
    """``rms_norm(h, norm_weight, eps) @ weight.T`` and ``h``, where h is ``x + residual``
    (rounded to x's dtype) or x itself: one kernel (``norm_available`` says where)."""
    eps_bits = struct.unpack("<i", struct.pack("<f", eps))[0]  # the kernel reads it back as a float
    if residual is None:
        return _call("norm", [x, norm_weight], weight, [("EPS", eps_bits)], layout)[0], x
    y, total = _call("add_norm", [x, residual, norm_weight], weight, [("EPS", eps_bits)], layout, outputs=2)
    return y, total
