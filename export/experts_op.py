"""The ``llm::experts`` op: the routed experts of one mixture-of-experts block.

HF computes the experts as a loop over the experts a batch hit (``nonzero``,
``index_add_``), which is data-dependent and does not export. This op is the same
computation as one functional call over 3-D expert weights, so the routing (router,
top-k, normalisation) stays ordinary traced ops and only the gather of expert weights by
selected index is opaque to the tracer; the interpreter runs it on ``mx.gather_mm``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from mlx_pte.ir.catalog_moe import CLAMPED_SWIGLU, EXPERT_ACTIVATIONS

from .experts_layout import clamped_swiglu

OP_NAME = "llm::experts"

# The catalog's activations that HF names by ``hidden_act`` (the clamped SwiGLU is gpt-oss's
# own gate, recognised by its module, not by a config name).
ACTIVATIONS = tuple(a for a in EXPERT_ACTIVATIONS if a != CLAMPED_SWIGLU)


def _gated(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    if activation == CLAMPED_SWIGLU:
        return clamped_swiglu(gate, up, alpha, limit)
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh" if activation == "gelu_pytorch_tanh" else "none") * up


@torch.library.custom_op(OP_NAME, mutates_args=())
def experts(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
    gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
    alpha: float = 0.0,
    limit: float = 0.0,
) -> torch.Tensor:
    """``sum_j weights[t, j] * (down[e] @ gated + down_bias[e])`` with ``e = indices[t, j]``,
    ``[gate; up] = gate_up[e] @ x[t] + gate_up_bias[e]`` and ``gated = act(gate) * up`` (or
    gpt-oss's ``clamped_swiglu(gate, up, alpha, limit)``).

    x ``[T, H]``, indices ``int64[T, k]``, weights ``[T, k]`` (x's dtype), gate_up
    ``[E, 2I, H]`` (gate rows first, then up rows), down ``[E, H, I]``, the biases (both
    or neither) ``[E, 2I]`` and ``[E, H]``. Returns ``[T, H]``.
    """
    proj = torch.einsum("th,tkoh->tko", x, gate_up[indices])
    if gate_up_bias is not None:
        proj = proj + gate_up_bias[indices]
    gate, up = proj.chunk(2, dim=-1)
    y = torch.einsum("tki,tkhi->tkh", _gated(gate, up, activation, alpha, limit), down[indices])
    if down_bias is not None:
        y = y + down_bias[indices]
    return (y * weights[..., None]).sum(dim=1).to(x.dtype)


@experts.register_fake
def _experts_fake(x, indices, weights, gate_up, down, activation, gate_up_bias=None, down_bias=None, alpha=0.0,
                  limit=0.0):  # fmt: skip
    return x.new_empty(x.shape)
