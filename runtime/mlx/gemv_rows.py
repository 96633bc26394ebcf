"""The row a GEMV kernel of ``gemv_source.py`` multiplies, as CUDA source run before its
dot products: the input as given, an rms_norm of it (after a residual add), or a GLU of a
gate and an up row. Each sets ``x`` (the row, ``T*``) and ``x_stride``; a built row lives in
the block's shared memory, so the op it replaces costs no kernel of its own.
"""
from __future__ import annotations

from dataclasses import dataclass

# Sets ``x`` (the row, T*) and ``x_stride`` for the dot products that follow: the input as given.
_ROW_FROM_INPUT = """
    const long long x_stride = x_strides[x_ndim - 1];
"""

# Sets them to the row normalized in shared memory: every block normalizes the whole row
# itself (a few KB read from L2), so the norm, and the residual add before it, cost no
# kernel of their own. Rounding follows ``rms_norm``'s catalog rule: the sum rounded to T,
# x * rsqrt(mean(x**2) + eps) in float rounded to T, times the weight rounded to T.
# Where the operands are contiguous and start on 16 bytes, each pass reads them 16 bytes a
# load, NORM_LOADS chunks of each loaded before any is used (one trip to L2 a pass, where
# one element a load costs a trip for every few elements); else one element a load.
# The {...} fields read the residual and write the sum (block 0), or not: _NORM_OPERANDS.
_ROW_FROM_NORM = """
    __shared__ PteChunk staged[(IN * sizeof(T) + 15) / 16];  // 16-byte aligned for the loads below
    __shared__ float partial[WARPS];
    T* normed = reinterpret_cast<T*>(staged);
    const long long a_step = a_strides[a_ndim - 1];
    const long long g_step = g_strides[g_ndim - 1];
    constexpr int NORM_VEC = 16 / sizeof(T);  // elements per 16-byte load
    constexpr int NORM_CHUNKS = IN / NORM_VEC;
    constexpr int NORM_LOADS = 4;
    const bool sum_vector = a_step == 1 && IN % NORM_VEC == 0 && (reinterpret_cast<size_t>(a) % 16) == 0{sum_aligned};
    float squares = 0.0f;
    if (sum_vector) {{
        for (int base = threadIdx.x; base < NORM_CHUNKS; base += NORM_LOADS * WARPS * 32) {{
            PteChunk a_chunks[NORM_LOADS];{declare_b}
            #pragma unroll
            for (int k = 0; k < NORM_LOADS; ++k) {{
                const int c = base + k * WARPS * 32;
                a_chunks[k] = c < NORM_CHUNKS ? reinterpret_cast<const PteChunk*>(a)[c] : PteChunk{{}};{load_b}
            }}
            #pragma unroll
            for (int k = 0; k < NORM_LOADS; ++k) {{
                const int c = base + k * WARPS * 32;
                if (c < NORM_CHUNKS) {{
                    const T* as = reinterpret_cast<const T*>(&a_chunks[k]);{view_b}
                    PteChunk h_chunk;
                    T* hs = reinterpret_cast<T*>(&h_chunk);
                    #pragma unroll
                    for (int j = 0; j < NORM_VEC; ++j) {{
                        hs[j] = {vector_sum};
                        const float hf = static_cast<float>(hs[j]);
                        squares += hf * hf;
                    }}
                    staged[c] = h_chunk;{vector_write}
                }}
            }}
        }}
    }} else {{
        for (int i = threadIdx.x; i < IN; i += WARPS * 32) {{
            const T h = {scalar_sum};
            {scalar_write}
            const float hf = static_cast<float>(h);
            squares += hf * hf;
            normed[i] = h;
        }}
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
    const auto normalize = [scale](T h, T weight) {{
        const T unit = static_cast<T>(static_cast<float>(h) * scale);
        return static_cast<T>(static_cast<float>(unit) * static_cast<float>(weight));
    }};
    if (g_step == 1 && IN % NORM_VEC == 0 && (reinterpret_cast<size_t>(g) % 16) == 0) {{
        // Each thread rewrites the chunks it wrote above (or, after the scalar pass, others:
        // the barrier above orders them).
        for (int base = threadIdx.x; base < NORM_CHUNKS; base += NORM_LOADS * WARPS * 32) {{
            PteChunk g_chunks[NORM_LOADS];
            #pragma unroll
            for (int k = 0; k < NORM_LOADS; ++k) {{
                const int c = base + k * WARPS * 32;
                g_chunks[k] = c < NORM_CHUNKS ? reinterpret_cast<const PteChunk*>(g)[c] : PteChunk{{}};
            }}
            #pragma unroll
            for (int k = 0; k < NORM_LOADS; ++k) {{
                const int c = base + k * WARPS * 32;
                if (c < NORM_CHUNKS) {{
                    PteChunk chunk = staged[c];
                    T* hs = reinterpret_cast<T*>(&chunk);
                    const T* gs = reinterpret_cast<const T*>(&g_chunks[k]);
                    #pragma unroll
                    for (int j = 0; j < NORM_VEC; ++j) {{
                        hs[j] = normalize(hs[j], gs[j]);
                    }}
                    staged[c] = chunk;
                }}
            }}
        }}
    }} else {{
        for (int i = threadIdx.x; i < IN; i += WARPS * 32) {{
            normed[i] = normalize(normed[i], g[i * g_step]);
        }}
    }}
    __syncthreads();
    const T* x = normed;
    const long long x_stride = 1;
"""
# Sets them to a GLU's row built in shared memory: act(gate) * up, as the ``glu`` op rounds it
# (the activation in float rounded to T, times up rounded to T). Every block builds the whole
# row, as the fused norm does, so the GLU costs no kernel of its own. gate and up may be one
# operand (a fused gate/up projection), up then starting UP_AT elements in. Where both rows
# are contiguous and start on 16 bytes, a thread reads them 16 bytes a load (8192 bf16
# features: 4 loads of each a thread, where one element a load would be 32 each).
_ROW_FROM_GLU = """
    __shared__ PteChunk staged[(IN * sizeof(T) + 15) / 16];  // 16-byte aligned for the loads below
    T* glued = reinterpret_cast<T*>(staged);
    const long long gate_step = gate_strides[gate_ndim - 1];
    const long long up_step = up_strides[up_ndim - 1];
    const T* up_row = up + UP_AT * up_step;
    const auto glu_value = [](T gate_value, T up_value) {{
        const float g = static_cast<float>(gate_value);
        const T act = static_cast<T>({activation});
        return static_cast<T>(static_cast<float>(act) * static_cast<float>(up_value));
    }};
    constexpr int GLU_VEC = 16 / sizeof(T);  // elements per 16-byte load
    constexpr int GLU_CHUNKS = IN / GLU_VEC;
    constexpr int GLU_LOADS = 4;  // chunks of gate and of up a thread loads before using any
    const bool glu_vector = gate_step == 1 && up_step == 1 && IN % GLU_VEC == 0
        && (reinterpret_cast<size_t>(gate) % 16) == 0 && (reinterpret_cast<size_t>(up_row) % 16) == 0;
    if (glu_vector) {{
        // All loads of a pass are issued before the first is used, so a pass costs one trip
        // to L2, not GLU_LOADS; the GLU_VEC results of a chunk go to shared memory in one store.
        for (int base = threadIdx.x; base < GLU_CHUNKS; base += GLU_LOADS * WARPS * 32) {{
            PteChunk gate_chunks[GLU_LOADS];
            PteChunk up_chunks[GLU_LOADS];
            #pragma unroll
            for (int k = 0; k < GLU_LOADS; ++k) {{
                const int c = base + k * WARPS * 32;
                gate_chunks[k] = c < GLU_CHUNKS ? reinterpret_cast<const PteChunk*>(gate)[c] : PteChunk{{}};
                up_chunks[k] = c < GLU_CHUNKS ? reinterpret_cast<const PteChunk*>(up_row)[c] : PteChunk{{}};
            }}
            #pragma unroll
            for (int k = 0; k < GLU_LOADS; ++k) {{
                const int c = base + k * WARPS * 32;
                if (c < GLU_CHUNKS) {{
                    const T* gates = reinterpret_cast<const T*>(&gate_chunks[k]);
                    const T* ups = reinterpret_cast<const T*>(&up_chunks[k]);
                    PteChunk glued_chunk;
                    T* values = reinterpret_cast<T*>(&glued_chunk);
                    #pragma unroll
                    for (int j = 0; j < GLU_VEC; ++j) {{
                        values[j] = glu_value(gates[j], ups[j]);
                    }}
                    staged[c] = glued_chunk;
                }}
            }}
        }}
    }} else {{
        for (int i = threadIdx.x; i < IN; i += WARPS * 32) {{
            glued[i] = glu_value(gate[i * gate_step], up_row[i * up_step]);
        }}
    }}
    __syncthreads();
    const T* x = glued;
    const long long x_stride = 1;
"""
# The activations of ``glu`` in float, of g, by the formulas the glu handler uses.
GLU_ACTIVATIONS = {
    "silu": "g / (1.0f + expf(-g))",
    "gelu": "0.5f * g * (1.0f + erff(g / 1.4142135623730951f))",
    "gelu_tanh": "0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)))",
}
# The residual's parts of _ROW_FROM_NORM (with none, the row is a as it is).
_NORM_OPERANDS = {
    False: dict(sum_aligned="", declare_b="", load_b="", view_b="", vector_sum="as[j]", vector_write="",
                scalar_sum="a[i * a_step]", scalar_write=""),
    True: dict(
        sum_aligned=(" && b_strides[b_ndim - 1] == 1 && (reinterpret_cast<size_t>(b) % 16) == 0"
                     " && (reinterpret_cast<size_t>(total_row) % 16) == 0"),
        declare_b="\n            PteChunk b_chunks[NORM_LOADS];",
        load_b="\n                b_chunks[k] = c < NORM_CHUNKS ? reinterpret_cast<const PteChunk*>(b)[c] : PteChunk{};",
        view_b="\n                    const T* bs = reinterpret_cast<const T*>(&b_chunks[k]);",
        vector_sum="static_cast<T>(static_cast<float>(as[j]) + static_cast<float>(bs[j]))",
        vector_write="\n                    if (blockIdx.x == 0) { reinterpret_cast<PteChunk*>(total_row)[c] = h_chunk; }",
        scalar_sum="static_cast<T>(static_cast<float>(a[i * a_step]) + static_cast<float>(b[i * b_strides[b_ndim - 1]]))",
        scalar_write="if (blockIdx.x == 0) { total_row[i] = h; }",
    ),
}

ROW_KINDS = ("input", "norm", "add_norm", *(f"{act}_glu" for act in GLU_ACTIVATIONS))


@dataclass(frozen=True)
class RowSource:
    """A row kind's operands (after the weight's), outputs and source."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    prologue: str


def row_source(row: str) -> RowSource:
    """The source of ``row``, one of ``ROW_KINDS``: "input" (x as given), "norm" (rms_norm
    of x), "add_norm" (rms_norm of a residual add, whose sum is a second output) or
    "ACT_glu" (act(gate) * up)."""
    if row == "input":
        return RowSource(("x",), ("y",), _ROW_FROM_INPUT)
    if row.endswith("_glu"):
        activation = GLU_ACTIVATIONS[row.removesuffix("_glu")]
        return RowSource(("gate", "up"), ("y",), _ROW_FROM_GLU.format(activation=activation))
    if row not in ("norm", "add_norm"):
        raise ValueError(f"a GEMV row is one of {', '.join(ROW_KINDS)}, got {row!r}")
    residual = row == "add_norm"
    return RowSource(("a", "b", "g") if residual else ("a", "g"), ("y", "total_row") if residual else ("y",),
                     _ROW_FROM_NORM.format(**_NORM_OPERANDS[residual]))
