"""Experts stored in another layout than ``llm::experts``' (gpt-oss), converted to it.

``llm::experts`` takes ``gate_up [E, 2I, H]`` (gate rows, then up rows) and ``down
[E, H, I]``. gpt-oss stores ``gate_up_proj [E, H, 2I]`` with gate and up interleaved
(column ``2i`` is gate ``i``, ``2i + 1`` up ``i``: its ``_apply_gate`` reads ``[..., ::2]``
and ``[..., 1::2]``), ``down_proj [E, I, H]`` and biases ``[E, 2I]`` (interleaved too) and
``[E, H]``. Each such tensor is replaced before tracing by its converted value, so the
traced graph reads ordinary constants in the op's layout, and quantization packs them per
expert as it packs every other family's.

Its gate is the clamped SwiGLU ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``,
``g = min(gate, limit)``; a module whose ``_apply_gate`` computes anything else is refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .hf_errors import CheckpointError


@dataclass(frozen=True)
class Conversion:
    """One parameter's conversion: its new shape and the function that computes it."""

    shape: tuple[int, ...]
    fn: Callable[[torch.Tensor], torch.Tensor]


def _deinterleave(w: torch.Tensor) -> torch.Tensor:
    """Last axis ``[g0, u0, g1, u1, ...]`` -> ``[g0, g1, ..., u0, u1, ...]``."""
    return torch.cat([w[..., ::2], w[..., 1::2]], dim=-1)


def _gate_up(w: torch.Tensor) -> torch.Tensor:
    return _deinterleave(w).transpose(1, 2).contiguous()


def _down(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(1, 2).contiguous()


def _bias(w: torch.Tensor) -> torch.Tensor:
    return _deinterleave(w).contiguous()


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gate on split gate/up values (the formula of its ``_apply_gate``)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def is_interleaved(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an HF experts module in gpt-oss's layout (biased, transposed,
    gate and up interleaved)."""
    return (getattr(module, "has_gate", False), getattr(module, "has_bias", False),
            getattr(module, "is_transposed", False), getattr(module, "is_concatenated", True)) == (
            True, True, True, False)  # fmt: skip


def gate_parameters(module: torch.nn.Module) -> tuple[float, float]:
    """``(alpha, limit)`` of an interleaved module's clamped SwiGLU.

    Raises:
        CheckpointError: its gate is not the clamped SwiGLU (checked on probe values that
            cross both clamps).
    """
    name = type(module).__name__
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if not isinstance(alpha, (int, float)) or not isinstance(limit, (int, float)):
        raise CheckpointError(f"{name} stores interleaved gate/up experts with no clamped SwiGLU (alpha, limit)")
    probe = torch.linspace(-3 * limit - 1, 3 * limit + 1, 64, dtype=torch.float64).reshape(1, 64)
    gate, up = probe[..., ::2], probe[..., 1::2]
    with torch.no_grad():
        got = module._apply_gate(probe)
    if not torch.allclose(got, clamped_swiglu(gate, up, float(alpha), float(limit)), rtol=1e-12, atol=1e-12):
        raise CheckpointError(f"{name}'s gate is not gpt-oss's clamped SwiGLU; its experts do not export")
    return float(alpha), float(limit)


def conversions(module: torch.nn.Module) -> dict[str, Conversion]:
    """The parameters of ``module`` to convert (by attribute name), none unless interleaved.

    Raises:
        CheckpointError: the weights do not describe one set of experts.
    """
    if not is_interleaved(module):
        return {}
    gate_up, down = module.gate_up_proj, module.down_proj
    gate_up_bias, down_bias = module.gate_up_proj_bias, module.down_proj_bias
    experts, hidden, two_i = gate_up.shape
    if (tuple(down.shape) != (experts, two_i // 2, hidden) or two_i % 2
            or tuple(gate_up_bias.shape) != (experts, two_i) or tuple(down_bias.shape) != (experts, hidden)):  # fmt: skip
        raise CheckpointError(
            f"{type(module).__name__}'s gate_up_proj {tuple(gate_up.shape)}, down_proj {tuple(down.shape)} and "
            f"biases {tuple(gate_up_bias.shape)}, {tuple(down_bias.shape)} do not describe the same experts"
        )
    return {
        "gate_up_proj": Conversion((experts, two_i, hidden), _gate_up),
        "down_proj": Conversion((experts, hidden, two_i // 2), _down),
        "gate_up_proj_bias": Conversion((experts, two_i), _bias),
    }


def convert_in_place(model: torch.nn.Module, make: Callable[[torch.nn.Parameter, Conversion], torch.nn.Parameter]) -> None:
    """Replace every converted parameter of ``model``'s experts by ``make(old, conversion)``
    and record its gate's ``(alpha, limit)`` on it (``llm::experts`` then reads it as its own
    layout; the tracer cannot run the gate's probe, so it is run here)."""
    for module in model.modules():
        todo = conversions(module)
        if not todo:
            continue
        clamped = gate_parameters(module)
        for attr, conversion in todo.items():
            module._parameters[attr] = make(module._parameters[attr], conversion)
        module.mlx_pte_clamped = clamped


def converted(module: torch.nn.Module) -> Optional[tuple[float, float]]:
    """``(alpha, limit)`` of a module ``convert_in_place`` converted, else None."""
    return getattr(module, "mlx_pte_clamped", None)
