"""Handlers of the mixture-of-experts ops (``ir.catalog_moe``): ``topk`` and ``experts``.

``experts`` runs on ``mx.gather_mm``, which multiplies each token by the weights of the
experts it selected without materialising them. Prefill routes many tokens: there the
(token, expert) pairs are sorted by expert first, so each expert's weights are read in
one contiguous run (``sorted_indices``), and the results are put back in token order.
"""
from __future__ import annotations

from typing import Any

import mlx_pte.runtime.mlx.blas  # noqa: F401  (load an optimized BLAS before mlx.core)
import mlx.core as mx

from .handlers import _GLU, Args, RunContext, handles

# (token, expert) pairs from which sorting by expert pays for its two argsorts and gathers
# (mlx-lm's SwitchGLU sorts from the same count).
SORT_FROM_PAIRS = 64

# The catalog's activation names -> the glu handler's.
_GLU_NAMES = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


@handles("topk")
def _topk(args: Args, attrs: dict[str, Any], ctx: RunContext) -> tuple[mx.array, mx.array]:
    (x,) = args
    dim, k = attrs["dim"], attrs["k"]
    # MLX's argsort is stable, so equal values keep index order, as torch.topk returns them.
    order = mx.argsort(-x if attrs["largest"] else x, axis=dim)
    picked = mx.split(order, [k], axis=dim)[0]
    return mx.take_along_axis(x, picked, axis=dim), picked.astype(mx.int64)


@handles("experts")
def _experts(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    x, indices, weights, gate_up, down = args
    glu = _GLU[_GLU_NAMES[attrs["activation"]]]
    t, k = indices.shape
    ids = indices.astype(mx.uint32)
    gate_up_t, down_t = gate_up.swapaxes(-1, -2), down.swapaxes(-1, -2)
    if t * k >= SORT_FROM_PAIRS:
        flat = ids.reshape(-1)
        order = mx.argsort(flat)
        ids_sorted = flat[order]
        rows = mx.expand_dims(x[order // k], -2)  # [T*k, 1, H], grouped by expert
        h = mx.gather_mm(rows, gate_up_t, rhs_indices=ids_sorted, sorted_indices=True)
        gate, up = mx.split(h, 2, axis=-1)
        y = mx.gather_mm(glu(gate, up), down_t, rhs_indices=ids_sorted, sorted_indices=True)
        y = y[mx.argsort(order)].reshape(t, k, -1)
    else:
        h = mx.gather_mm(mx.expand_dims(x, (-2, -3)), gate_up_t, rhs_indices=ids)  # [T, k, 1, 2I]
        gate, up = mx.split(h, 2, axis=-1)
        y = mx.gather_mm(glu(gate, up), down_t, rhs_indices=ids).squeeze(-2)  # [T, k, H]
    return (y * mx.expand_dims(weights, -1)).sum(axis=1)
