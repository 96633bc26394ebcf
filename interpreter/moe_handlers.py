"""Handlers of the mixture-of-experts ops (``ir.catalog_moe``): ``topk``, ``experts`` and
``quantized_experts``; and upstream's ``gather_mm``, ``gather_qmm`` and ``item``, which run
as imported.

``experts`` runs on ``mx.gather_mm`` (``quantized_experts`` on ``mx.gather_qmm``), which multiplies each token by the weights of the
experts it selected without materialising them. Prefill routes many tokens: there the
(token, expert) pairs are sorted by expert first, so each expert's weights are read in
one contiguous run (``sorted_indices``), and the results are put back in token order.

MLX's CPU ``gather_mm`` is one BLAS call per (token, expert) pair, each packing that
expert's whole weight, whatever the order. So on the CPU, once the pairs are at least as
many as the experts, gate/up runs as one matmul over every expert's stacked rows (fewer
bytes read, one call) and the selected experts' outputs are taken from it. Packed experts
keep ``gather_qmm``: the CPU's quantized matmul costs the same per row either way, so
every expert's rows cost E/k times the selected ones (4x slower at 16 experts, top 4).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx_pte.runtime.mlx.blas  # noqa: F401  (load an optimized BLAS before mlx.core)
import mlx.core as mx

from mlx_pte.ir.catalog_moe import CLAMPED_SWIGLU

from mlx_pte.runtime.mlx.launcher import evaluate

from .handlers import _GLU, Args, RunContext, handles

# (token, expert) pairs from which sorting by expert pays for its two argsorts and gathers
# (mlx-lm's SwitchGLU sorts from the same count).
SORT_FROM_PAIRS = 64

# The catalog's activation names -> the glu handler's.
_GLU_NAMES = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}

# gate, up -> the gated values fed to down.
Gate = Callable[[mx.array, mx.array], mx.array]


def _gate(attrs: dict[str, Any]) -> Gate:
    if attrs["activation"] != CLAMPED_SWIGLU:
        return _GLU[_GLU_NAMES[attrs["activation"]]]
    alpha, limit = attrs["alpha"], attrs["limit"]

    def clamped(gate: mx.array, up: mx.array) -> mx.array:
        gate = mx.minimum(gate, limit)
        return (mx.clip(up, -limit, limit) + 1) * (gate * mx.sigmoid(gate * alpha))

    return clamped


@handles("topk")
def _topk(args: Args, attrs: dict[str, Any], ctx: RunContext) -> tuple[mx.array, mx.array]:
    (x,) = args
    dim, k = attrs["dim"], attrs["k"]
    # MLX's argsort is stable, so equal values keep index order, as torch.topk returns them.
    order = mx.argsort(-x if attrs["largest"] else x, axis=dim)
    picked = mx.split(order, [k], axis=dim)[0]
    return mx.take_along_axis(x, picked, axis=dim), picked.astype(mx.int64)


# (rows [..., 1, K], expert indices [...]) -> rows times each selected expert's weight.
ExpertMatmul = Callable[[mx.array, mx.array, bool], mx.array]


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of ``experts`` experts: per pair, and (dense weights) over every
    expert at once."""

    pairs: ExpertMatmul  # rows times the experts they selected
    every: Optional[Callable[[mx.array], mx.array]]  # x [T, K] -> [T, E, N]: x times every expert
    experts: int


def _biased(matmul: ExpertWeights, bias: Optional[mx.array]) -> ExpertWeights:
    """``matmul`` plus each expert's bias row (``bias`` [E, N]), when there is one."""
    if bias is None:
        return matmul
    return ExpertWeights(
        lambda rows, ids, is_sorted: matmul.pairs(rows, ids, is_sorted) + mx.expand_dims(bias[ids], -2),
        None if matmul.every is None else (lambda x: matmul.every(x) + bias), matmul.experts,
    )  # fmt: skip


def every_expert_pays(pairs: int, experts: int) -> bool:
    """Whether one matmul over every expert beats ``gather_mm`` over ``pairs`` (see the
    module docstring: on the CPU, from as many pairs as experts)."""
    return pairs >= experts and mx.default_device().type == mx.DeviceType.cpu


def _routed(x: mx.array, indices: mx.array, weights: mx.array, gate_up: ExpertWeights, down: ExpertWeights,
            gated: Gate) -> mx.array:  # fmt: skip
    t, k = indices.shape
    ids = indices.astype(mx.uint32)
    if gate_up.every is not None and every_expert_pays(t * k, gate_up.experts):
        picked = mx.take_along_axis(gate_up.every(x), mx.expand_dims(ids, -1), axis=1)  # [T, k, 2I]
        gate, up = mx.split(mx.expand_dims(picked, -2), 2, axis=-1)  # [T, k, 1, I] each
        y = down.pairs(gated(gate, up), ids, False).squeeze(-2)  # [T, k, H]
    elif t * k >= SORT_FROM_PAIRS:
        flat = ids.reshape(-1)
        order = mx.argsort(flat)
        ids_sorted = flat[order]
        rows = mx.expand_dims(x[order // k], -2)  # [T*k, 1, H], grouped by expert
        gate, up = mx.split(gate_up.pairs(rows, ids_sorted, True), 2, axis=-1)
        y = down.pairs(gated(gate, up), ids_sorted, True)
        y = y[mx.argsort(order)].reshape(t, k, -1)
    else:
        gate, up = mx.split(gate_up.pairs(mx.expand_dims(x, (-2, -3)), ids, False), 2, axis=-1)  # [T, k, 1, I] each
        y = down.pairs(gated(gate, up), ids, False).squeeze(-2)  # [T, k, H]
    return (y * mx.expand_dims(weights, -1)).sum(axis=1)


def _dense(w: mx.array) -> ExpertWeights:
    experts, n, k = w.shape
    w_t, stacked = w.swapaxes(-1, -2), w.reshape(experts * n, k)
    if w.dtype == mx.float32 or mx.default_device().type != mx.DeviceType.cpu:
        return ExpertWeights(
            lambda rows, ids, is_sorted: mx.gather_mm(rows, w_t, rhs_indices=ids, sorted_indices=is_sorted),
            lambda x: (x @ stacked.T).reshape(x.shape[0], experts, n), experts,
        )  # fmt: skip
    # MLX's CPU gather_mm runs float32 only (see _gather_mm below): compute in float32, round once.
    w_32, stacked_32 = w_t.astype(mx.float32), stacked.astype(mx.float32)
    return ExpertWeights(
        lambda rows, ids, is_sorted: mx.gather_mm(
            rows.astype(mx.float32), w_32, rhs_indices=ids, sorted_indices=is_sorted
        ).astype(rows.dtype),
        lambda x: (x.astype(mx.float32) @ stacked_32.T).astype(x.dtype).reshape(x.shape[0], experts, n),
        experts,
    )  # fmt: skip


def _packed(w: mx.array, scales: mx.array, biases: Optional[mx.array], attrs: dict[str, Any]) -> ExpertWeights:
    kwargs = {"group_size": attrs["group_size"], "bits": attrs["bits"], "mode": attrs["mode"]}
    return ExpertWeights(
        lambda rows, ids, is_sorted: mx.gather_qmm(
            rows, w, scales, biases, rhs_indices=ids, transpose=True, sorted_indices=is_sorted, **kwargs
        ),
        None, w.shape[0],
    )  # fmt: skip


@handles("experts")
def _experts(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    x, indices, weights, gate_up, down, *biases = args
    gate_up_bias, down_bias = biases or (None, None)
    return _routed(x, indices, weights, _biased(_dense(gate_up), gate_up_bias), _biased(_dense(down), down_bias),
                   _gate(attrs))  # fmt: skip


@handles("quantized_experts")
def _quantized_experts(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    x, indices, weights, *parts = args
    gate_up_bias, down_bias = parts[6:] or (None, None)
    gate_up = _biased(_packed(*parts[:3], attrs), gate_up_bias)
    down = _biased(_packed(*parts[3:6], attrs), down_bias)
    return _routed(x, indices, weights, gate_up, down, _gate(attrs))


# -- upstream's MoE matmuls (ir.catalog_moe: gather_mm, gather_qmm, item) ----------------
@handles("gather_mm")
def _gather_mm(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    a, b, lhs, rhs = args
    dtype = a.dtype
    # MLX's CPU gather_mm runs float32 only; its GPU kernels accumulate half types in float32
    # and round once, which computing in float32 and casting back also gives.
    if dtype != mx.float32 and mx.default_device().type == mx.DeviceType.cpu:
        a, b = a.astype(mx.float32), b.astype(mx.float32)
    out = mx.gather_mm(a, b, lhs_indices=lhs, rhs_indices=rhs, sorted_indices=bool(attrs["sorted_indices"]))
    return out.astype(dtype)


@handles("gather_qmm")
def _gather_qmm(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    x, w, scales, biases, lhs, rhs = args
    return mx.gather_qmm(
        x, w, scales, biases, lhs_indices=lhs, rhs_indices=rhs, transpose=attrs["transpose"],
        group_size=attrs["group_size"], bits=attrs["bits"], mode=attrs["mode"],
        sorted_indices=bool(attrs["sorted_indices"]),
    )  # fmt: skip


@handles("item")
def _item(args: Args, attrs: dict[str, Any], ctx: RunContext) -> int:
    evaluate([args[0]])
    return int(args[0].item())
