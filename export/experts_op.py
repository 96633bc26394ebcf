"""The ``llm::experts`` op: the routed experts of one mixture-of-experts block.

HF computes the experts as a loop over the experts a batch hit (``nonzero``,
``index_add_``), which is data-dependent and does not export. This op is the same
computation as one functional call over 3-D expert weights, so the routing (router,
top-k, normalisation) stays ordinary traced ops and only the gather of expert weights by
selected index is opaque to the tracer; the interpreter runs it on ``mx.gather_mm``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

OP_NAME = "llm::experts"

# The gated activations ``act(gate) * up`` an expert may use (HF's ``hidden_act`` names).
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")


def _act(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if activation == "gelu_pytorch_tanh" else "none")


@torch.library.custom_op(OP_NAME, mutates_args=())
def experts(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """``sum_j weights[t, j] * down[e] @ (act(gate) * up)`` with ``e = indices[t, j]``.

    x ``[T, H]``, indices ``int64[T, k]``, weights ``[T, k]`` (x's dtype), gate_up
    ``[E, 2I, H]`` (gate rows first, then up rows), down ``[E, H, I]``. Returns ``[T, H]``.
    """
    gate, up = torch.einsum("th,tkoh->tko", x, gate_up[indices]).chunk(2, dim=-1)
    h = _act(gate, activation) * up
    y = torch.einsum("tki,tkhi->tkh", h, down[indices])
    return (y * weights[..., None]).sum(dim=1).to(x.dtype)


@experts.register_fake
def _experts_fake(x, indices, weights, gate_up, down, activation):
    return x.new_empty(x.shape)
