"""Decode attention over rows of unequal history, in one CUDA kernel.

A batched-sequence decode step attends one query per pool row over the slots that row's
query may see. MLX's fused SDPA takes no per-row extent, so rows that see different slots
need a mask, and on CUDA an array mask sends SDPA to its unfused fallback (a matmul, a
masked softmax and a second matmul per layer, each a kernel the host encodes every
step). This kernel reads each row's query position from a device array instead and
derives what the row sees: one kernel per layer and no mask to build.

What a row sees, from its query position p (-1: the row is not in the step, and its
output is zeros):
  flat layer: slots [0, p], slot s holding position s;
  ring of R slots with window W: slot s holds the position congruent to s in (p - R, p],
    visible when it is >= 0 (written) and > p - W.
Scores may be capped (``softcap * tanh(s / softcap)``, before the softmax) and per-head
sink logits may join the softmax's denominator (gpt-oss), as ``attention.attend`` does.

One thread block per (row, query head). Its warps take the row's slots in turn (warp w
reads slots w, w + WARPS, ...), each lane holding ``D / 32`` elements of the head dim, and
keep an online softmax; the block then merges its warps' partial sums (and the sink).
GQA is native: query head h reads KV head ``h // groups``. Strides are read from the
arrays, so pool views and transposed queries go in without a copy.
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
    constexpr float LOG2_E = 1.44269504088896341f;  // scores in log2 units: exp2 in place of exp
    const int head = blockIdx.x;
    const int row = blockIdx.y;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int kv_head = head / GROUPS;
    const int newest = newest_pos[row];
    const float scale = params[0];
    const float softcap = params[1];
    const float neg_inf = __int_as_float(0xff800000);
    // A flat layer's row sees slots [0, newest]; a ring's may see any slot read.
    const int end = SLOTS == 0 ? newest + 1 : k_shape[2];

    const TQ* q_at = q + row * q_strides[0] + head * q_strides[1] + lane * PER_LANE * q_strides[2];
    const TKV* k_at = k + row * k_strides[0] + kv_head * k_strides[1] + lane * PER_LANE * k_strides[3];
    const TKV* v_at = v + row * v_strides[0] + kv_head * v_strides[1] + lane * PER_LANE * v_strides[3];
    float query[PER_LANE];
    float acc[PER_LANE];
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        query[i] = static_cast<float>(q_at[i * q_strides[2]]) * scale;
        acc[i] = 0.0f;
    }
    float top = neg_inf;  // running max of this warp's scores (log2 units)
    float total = 0.0f;     // running sum of exp2(score - top)
    for (int key = warp; key < end; key += WARPS) {
        if (SLOTS > 0) {  // the whole warp takes or skips the slot: the branch is uniform
            constexpr int ring = SLOTS > 0 ? SLOTS : 1;  // no constant division by zero when flat
            const int position = newest - ((newest - key) % ring + ring) % ring;
            if (position < 0 || (WINDOW > 0 && position <= newest - WINDOW)) {
                continue;
            }
        }
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
        if (SOFTCAP) {
            score = softcap * tanhf(score / softcap);
        }
        score *= LOG2_E;
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
        // The sink is one more score, with no value: it only grows the denominator.
        const float sink = SINKS ? static_cast<float>(sinks[head]) * LOG2_E : neg_inf;
        float best = sink;
        for (int w = 0; w < WARPS; ++w) {
            best = fmaxf(best, tops[w]);
        }
        float sum = SINKS ? exp2f(sink - best) : 0.0f;
        float value = 0.0f;
        for (int w = 0; w < WARPS; ++w) {
            if (tops[w] > neg_inf) {  // a warp that read no key adds nothing
                const float rescale = exp2f(tops[w] - best);
                sum += totals[w] * rescale;
                value += partial[w][element] * rescale;
            }
        }
        // A row that sees no key (outside the step) gets zeros, not NaN.
        out[(row * gridDim.x + head) * D + element] = static_cast<TQ>(sum > 0.0f ? value / sum : 0.0f);
    }
"""

# The bench turns this off to time the masked path in the same run.
enabled = True
# Asked once: availability checks run on every attention call of a decode step.
_ON_CUDA = mx.cuda.is_available()
_kernel: Optional[Callable] = None
# Device constants made once, not uploaded per call: (scale, softcap) pairs, and the
# stand-in for absent sinks (the kernel's signature is fixed; SINKS says whether to read).
_params: dict[tuple[float, float], mx.array] = {}
_no_sinks: Optional[mx.array] = None


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
    q: mx.array,
    k: mx.array,
    v: mx.array,
    newest: mx.array,
    scale: float,
    *,
    ring_slots: int = 0,
    window: int = 0,
    softcap: float = 0.0,
    sinks: Optional[mx.array] = None,
) -> mx.array:
    """softmax(cap(q k^T * scale)) v per row, row b over the slots its query at position
    ``newest[b]`` sees (module docstring).

    Args:
        q: [B, Hq, 1, D], one query per row.
        k: [B, Hkv, S, D], any strides (a view of a pool).
        v: [B, Hkv, S, D].
        newest: int32 [B], each row's query position, flat rows at most S - 1; -1 gives
            the row zeros.
        scale: multiplies q.k.
        ring_slots: the ring's slot count R; 0 for a flat layer.
        window: a ring's window W (positions > p - W are visible); 0 for none.
        softcap: > 0 replaces scores s by ``softcap * tanh(s / softcap)``.
        sinks: [Hq] per-head sink logits in the softmax's denominator, or None.

    Returns:
        [B, Hq, 1, D] in q's dtype.
    """
    global _kernel, _no_sinks
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="mlx_pte_decode_attention",
            input_names=["q", "k", "v", "newest_pos", "params", "sinks"],
            output_names=["out"],
            source=_SOURCE,
            header="#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n",
            ensure_row_contiguous=False,
        )
        _no_sinks = mx.zeros((1,), mx.float32)
    rows, q_heads, _, dim = q.shape
    key = (float(scale), float(softcap))
    if key not in _params:
        _params[key] = mx.array(key, mx.float32)
    sink_logits = _no_sinks if sinks is None else sinks
    out = _kernel(
        inputs=[q.squeeze(2), k, v, newest, _params[key], sink_logits],
        # MLX names a compiled kernel by its template only, so every input dtype that changes
        # the source is in it (TSINK: the sinks' element type).
        template=[("TQ", q.dtype), ("TKV", k.dtype), ("TSINK", sink_logits.dtype), ("D", dim),
                  ("GROUPS", q_heads // k.shape[1]), ("WARPS", WARPS), ("SLOTS", ring_slots),
                  ("WINDOW", window if ring_slots else 0), ("SOFTCAP", softcap > 0), ("SINKS", sinks is not None)],
        grid=(q_heads * 32 * WARPS, rows, 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(rows, q_heads, dim)],
        output_dtypes=[q.dtype],
    )[0]
    return out[:, :, None, :]
