"""Decode attention over rows of unequal length, in one CUDA kernel.

A batched-sequence decode step attends one query per pool row over that row's first
``length`` slots. MLX's fused SDPA takes no per-row length, so rows of unequal length
need a mask, and on CUDA an array mask sends SDPA to its unfused fallback (a matmul, a
masked softmax and a second matmul per layer, each a kernel the host encodes every
step). This kernel reads each row's length from a device array instead: one kernel per
layer and no mask to build.

One thread block per (row, query head). Its warps take the row's keys in turn (warp w
reads keys w, w + WARPS, ...), each lane holding ``D / 32`` elements of the head dim, and
keep an online softmax; the block then merges its warps' partial sums. GQA is native:
query head h reads KV head ``h // groups``. Strides are read from the arrays, so pool
views and transposed queries go in without a copy.
"""
from __future__ import annotations

from typing import Callable, Optional

from mlx_pte.runtime.mlx.bootstrap import mx

WARPS = 8
# Head dims the kernel takes: D / 32 elements per lane, and the merge uses one thread per
# element of the head dim, so D <= 32 * WARPS.
HEAD_DIMS = (64, 96, 128, 256)

_SOURCE = """
    constexpr int PER_LANE = D / 32;
    const int head = blockIdx.x;
    const int row = blockIdx.y;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int kv_head = head / GROUPS;
    const int length = lengths[row];
    const float scale_log2 = scale[0] * 1.44269504088896341f;  // exp2 in place of exp
    const float neg_inf = __int_as_float(0xff800000);

    const TQ* q_at = q + row * q_strides[0] + head * q_strides[1] + lane * PER_LANE * q_strides[2];
    const TKV* k_at = k + row * k_strides[0] + kv_head * k_strides[1] + lane * PER_LANE * k_strides[3];
    const TKV* v_at = v + row * v_strides[0] + kv_head * v_strides[1] + lane * PER_LANE * v_strides[3];
    float query[PER_LANE];
    float acc[PER_LANE];
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        query[i] = static_cast<float>(q_at[i * q_strides[2]]) * scale_log2;
        acc[i] = 0.0f;
    }
    float top = neg_inf;  // running max of this warp's scores (log2 units)
    float total = 0.0f;     // running sum of exp2(score - top)
    for (int key = warp; key < length; key += WARPS) {
        const TKV* k_row = k_at + key * k_strides[2];
        const TKV* v_row = v_at + key * v_strides[2];
        float score = 0.0f;
        #pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            score += query[i] * static_cast<float>(k_row[i * k_strides[3]]);
        }
        #pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) {
            score += __shfl_xor_sync(0xffffffff, score, offset);
        }
        const float new_top = fmaxf(top, score);
        const float rescale = exp2f(top - new_top);
        const float weight = exp2f(score - new_top);
        total = total * rescale + weight;
        #pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            acc[i] = acc[i] * rescale + weight * static_cast<float>(v_row[i * v_strides[3]]);
        }
        top = new_top;
    }

    __shared__ float tops[WARPS];
    __shared__ float totals[WARPS];
    __shared__ float partial[WARPS][D];
    if (lane == 0) {
        tops[warp] = top;
        totals[warp] = total;
    }
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        partial[warp][lane * PER_LANE + i] = acc[i];
    }
    __syncthreads();
    const int element = threadIdx.x;
    if (element < D) {
        float best = neg_inf;
        for (int w = 0; w < WARPS; ++w) {
            best = fmaxf(best, tops[w]);
        }
        float sum = 0.0f;
        float value = 0.0f;
        for (int w = 0; w < WARPS; ++w) {
            if (tops[w] > neg_inf) {  // a warp that read no key adds nothing
                const float rescale = exp2f(tops[w] - best);
                sum += totals[w] * rescale;
                value += partial[w][element] * rescale;
            }
        }
        // A row with no key (outside the step) gets zeros, not NaN.
        out[(row * gridDim.x + head) * D + element] = static_cast<TQ>(sum > 0.0f ? value / sum : 0.0f);
    }
"""

# The bench turns this off to time the masked path in the same run.
enabled = True
# Asked once: availability checks run on every attention call of a decode step.
_ON_CUDA = mx.cuda.is_available()
_kernel: Optional[Callable] = None
_scales: dict[float, mx.array] = {}


def available(q: mx.array, k: mx.array, v: mx.array) -> bool:
    """Whether ``decode_attention`` runs these shapes on this process's default device."""
    return (
        enabled
        and _ON_CUDA
        and mx.default_device() == mx.gpu
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
        and q.shape[-1] in HEAD_DIMS
        and q.shape[1] % k.shape[1] == 0
    )


def decode_attention(
    q: mx.array, k: mx.array, v: mx.array, lengths: mx.array, scale: float
) -> mx.array:
    """softmax(q k^T * scale) v per row, row b over its keys ``[0, lengths[b])``.

    Args:
        q: [B, Hq, 1, D], one query per row.
        k: [B, Hkv, S, D], any strides (a view of a pool).
        v: [B, Hkv, S, D].
        lengths: int32 [B], each at most S; 0 gives the row zeros.
        scale: multiplies q.k.

    Returns:
        [B, Hq, 1, D] in q's dtype.
    """
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="mlx_pte_decode_attention",
            input_names=["q", "k", "v", "lengths", "scale"],
            output_names=["out"],
            source=_SOURCE,
            header="#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n",
            ensure_row_contiguous=False,
        )
    rows, q_heads, _, dim = q.shape
    if scale not in _scales:  # one device scalar per scale, not one upload per call
        _scales[scale] = mx.array(scale, mx.float32)
    out = _kernel(
        inputs=[q.squeeze(2), k, v, lengths, _scales[scale]],
        template=[("TQ", q.dtype), ("TKV", k.dtype), ("D", dim), ("GROUPS", q_heads // k.shape[1]),
                  ("WARPS", WARPS)],
        grid=(q_heads * 32 * WARPS, rows, 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(rows, q_heads, dim)],
        output_dtypes=[q.dtype],
    )[0]
    return out[:, :, None, :]
