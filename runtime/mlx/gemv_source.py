"""The CUDA source of ``gemv.py``'s kernels: one row times a weight, the row first set up
by ``gemv_rows.py`` (the input as given, an rms_norm of it, or a GLU).

Layout: ``WARPS`` warps per block in groups of ``SPLIT``, each group computing ``ROWS``
consecutive output rows; the group's warps take turns over a row's runs of 32 16-byte
chunks, a lane reading one chunk of a run, of each row and of x, and accumulating in float.
A warp sums its lanes by shuffles and, with SPLIT > 1, the group's first warp sums the
group's warps through shared memory. SPLIT puts more loads in flight for a long row over
few outputs (the down projection's 8192 features over 2048 rows), but a fused row is then
built by more blocks: on an H100 the model's decode ran 0.82-1.00x as fast split as not.
Strides are read from the arrays, so no input is copied: rows whose stride, alignment or
inner stride rule out 16-byte loads take a strided loop (the branch is uniform over the
whole grid).
"""
from __future__ import annotations

from dataclasses import dataclass

from mlx_pte.runtime.mlx.bootstrap import mx
from mlx_pte.runtime.mlx.gemv_rows import row_source

# Each group of SPLIT warps takes ROWS consecutive output rows from ``first``, its warp
# ``part`` the runs part, part + SPLIT, ... of each row. After the row's set-up, which may
# synchronize the block, a warp with no rows leaves here, unless its group's sum below
# synchronizes the block again (it then reads its rows clamped to the last, as spare rows do).
_WARP_ROWS = """
    static_assert(WARPS % SPLIT == 0, "a block holds whole groups of SPLIT warps");
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int part = warp % SPLIT;
    const int first = (blockIdx.x * (WARPS / SPLIT) + warp / SPLIT) * ROWS;
    if (SPLIT == 1 && first >= OUT) {
        return;
    }
    float acc[ROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        acc[r] = 0.0f;
    }
"""

# The dot products of a dense w's rows with x.
_DENSE_DOT = """
    constexpr int VEC = 16 / sizeof(T);  // elements per 16-byte load
    constexpr int CHUNKS = IN / VEC;
    const long long row_stride = w_strides[0];
    const long long col_stride = w_strides[1];
    // Rows past OUT (a last warp's spare rows) read the last row again and are not written.
    const T* rows[ROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        rows[r] = w + (first + r < OUT ? first + r : OUT - 1) * row_stride;
    }
    const bool vector = col_stride == 1 && x_stride == 1 && IN % VEC == 0 && row_stride % VEC == 0
        && (reinterpret_cast<size_t>(w) % 16) == 0 && (reinterpret_cast<size_t>(x) % 16) == 0;
    if (vector) {
        // UNROLL chunks of x and of each row are loaded before any is used, so a lane keeps
        // that many 16-byte loads per row in flight; chunks past the row's end load as zeros.
        constexpr int STEPS = (CHUNKS + 32 * SPLIT - 1) / (32 * SPLIT);  // runs of 32 chunks a warp reads
        const PteChunk* xv = reinterpret_cast<const PteChunk*>(x);
        for (int step = 0; step < STEPS; step += UNROLL) {
            PteChunk xc[UNROLL];
            PteChunk wc[UNROLL][ROWS];
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int i = lane + ((step + u) * SPLIT + part) * 32;
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
        for (int i = lane + part * 32; i < IN; i += 32 * SPLIT) {
            const float xi = static_cast<float>(x[i * x_stride]);
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                acc[r] += static_cast<float>(rows[r][i * col_stride]) * xi;
            }
        }
    }
"""

# The dot products of a 4-bit affine w's rows with x (MLX's packing: w is uint32, 8 values a
# word, the first in the low bits; a value v of group g stands for scales[g] * v + biases[g],
# GROUP values a group). A 16-byte chunk of a row is 32 values of one group (GROUP is a
# multiple of 32), so it adds scale * sum(v * x) + bias * sum(x) over its 32 x values.
_AFFINE4_DOT = """
    constexpr int VALUES = 32;  // values per 16-byte chunk of a packed row
    constexpr int CHUNKS = IN / VALUES;
    constexpr int XVEC = 16 / sizeof(T);  // x values per 16-byte load
    const long long row_stride = w_strides[0];
    const long long word_stride = w_strides[1];
    int rows[ROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        rows[r] = first + r < OUT ? first + r : OUT - 1;
    }
    const auto group_scale = [&](int row, int i) {
        return static_cast<float>(scales[row * scales_strides[0] + (i / GROUP) * scales_strides[1]]);
    };
    const auto group_bias = [&](int row, int i) {
        return static_cast<float>(biases[row * biases_strides[0] + (i / GROUP) * biases_strides[1]]);
    };
    const bool vector = word_stride == 1 && x_stride == 1 && IN % VALUES == 0 && row_stride % 4 == 0
        && (reinterpret_cast<size_t>(w) % 16) == 0 && (reinterpret_cast<size_t>(x) % 16) == 0;
    if (vector) {
        // As in the dense dot: UNROLL chunks of each row (with their scale and bias) are
        // loaded before any is used; x is read where it is used (it stays in L1).
        constexpr int STEPS = (CHUNKS + 32 * SPLIT - 1) / (32 * SPLIT);
        for (int step = 0; step < STEPS; step += UNROLL) {
            PteChunk wc[UNROLL][ROWS];
            float sc[UNROLL][ROWS];
            float bc[UNROLL][ROWS];
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int i = lane + ((step + u) * SPLIT + part) * 32;
                const bool inside = step + u < STEPS && i < CHUNKS;
                #pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    wc[u][r] = inside ? reinterpret_cast<const PteChunk*>(w + rows[r] * row_stride)[i] : PteChunk{};
                    sc[u][r] = inside ? group_scale(rows[r], i * VALUES) : 0.0f;
                    bc[u][r] = inside ? group_bias(rows[r], i * VALUES) : 0.0f;
                }
            }
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int i = lane + ((step + u) * SPLIT + part) * 32;
                if (step + u >= STEPS || i >= CHUNKS) {
                    continue;
                }
                float xs[VALUES];
                float xsum = 0.0f;
                const PteChunk* xv = reinterpret_cast<const PteChunk*>(x + i * VALUES);
                #pragma unroll
                for (int c = 0; c < VALUES / XVEC; ++c) {
                    const PteChunk loaded = xv[c];
                    const T* values = reinterpret_cast<const T*>(&loaded);
                    #pragma unroll
                    for (int j = 0; j < XVEC; ++j) {
                        xs[c * XVEC + j] = static_cast<float>(values[j]);
                        xsum += xs[c * XVEC + j];
                    }
                }
                #pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    float dot = 0.0f;
                    #pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        const unsigned int word = wc[u][r].word[k];
                        #pragma unroll
                        for (int j = 0; j < 8; ++j) {
                            dot += static_cast<float>((word >> (4 * j)) & 15u) * xs[k * 8 + j];
                        }
                    }
                    acc[r] += sc[u][r] * dot + bc[u][r] * xsum;
                }
            }
        }
    } else {
        for (int i = lane + part * 32; i < IN; i += 32 * SPLIT) {
            const float xi = static_cast<float>(x[i * x_stride]);
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const unsigned int word = w[rows[r] * row_stride + (i / 8) * word_stride];
                const float v = static_cast<float>((word >> (4 * (i % 8))) & 15u);
                acc[r] += (group_scale(rows[r], i) * v + group_bias(rows[r], i)) * xi;
            }
        }
    }
"""

# The warp's sums into y; with SPLIT > 1, the group's first warp adds the group's sums, in
# order of part (the same order on every run).
_WRITE_ROWS = """
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        #pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) {
            acc[r] += __shfl_xor_sync(0xffffffff, acc[r], offset);
        }
    }
    if (SPLIT > 1) {
        __shared__ float group_sums[WARPS][ROWS];
        if (lane == 0) {
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                group_sums[warp][r] = acc[r];
            }
        }
        __syncthreads();
        if (part == 0) {
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                acc[r] = 0.0f;
                #pragma unroll
                for (int p = 0; p < SPLIT; ++p) {
                    acc[r] += group_sums[warp + p][r];
                }
            }
        }
    }
    if (lane == 0 && part == 0) {
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (first + r < OUT) {
                y[first + r] = static_cast<T>(acc[r]);
            }
        }
    }
"""

# PteChunk: 16 bytes, loaded and stored whole (one 128-bit access), with no vector type needed.
HEADER = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
struct alignas(16) PteChunk { unsigned int word[4]; };
"""
# The C++ types of the dtypes these kernels see, as MLX names them in a kernel's source.
CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.uint32: "uint32_t"}


def template_declarations(template: list[tuple[str, object]], indent: str) -> str:
    """``mx.fast.cuda_kernel``'s template arguments as the lines it puts before the source:
    a dtype as a type alias, a number as a constant."""
    return "".join(f"{indent}using {k} = {CUDA_TYPES[v]};\n" if isinstance(v, mx.Dtype)
                   else f"{indent}constexpr int {k} = {v};\n" for k, v in template)


@dataclass(frozen=True)
class KernelSource:
    """What ``mx.fast.cuda_kernel`` is given for one kernel (``HEADER`` goes with each)."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    source: str

    def parameters(self) -> list[tuple[str, str]]:
        """(name, kind) of the kernel function's parameters, in the order MLX 0.32's
        ``cuda_kernel`` declares them (``mlx/backend/cuda/custom_kernel.cpp``): each input's
        pointer ("input"), then its "shape", "strides" and "ndim" where the source reads
        them; then each "output"'s pointer."""
        params = []
        for name in self.inputs:
            params.append((name, "input"))
            params += [(f"{name}_{kind}", kind) for kind in ("shape", "strides", "ndim")
                       if f"{name}_{kind}" in self.source]
        return params + [(name, "output") for name in self.outputs]


def kernel_source(packed: bool, row: str) -> KernelSource:
    """The kernel over a dense (or 4-bit ``packed``) weight whose row is ``row``, one of
    ``gemv_rows.ROW_KINDS``."""
    built = row_source(row)
    weights, dot = (("w", "scales", "biases"), _AFFINE4_DOT) if packed else (("w",), _DENSE_DOT)
    return KernelSource(f"mlx_pte_{'q4_' if packed else ''}{row}_gemv", weights + built.inputs, built.outputs,
                        built.prologue + _WARP_ROWS + dot + _WRITE_ROWS)
