"""HF mixture-of-experts blocks rewritten onto ``llm::experts``, with no change to modeling code.

transformers 5 dispatches every ``@use_experts_implementation`` experts module through
its experts registry (``config._experts_implementation``); importing this module
registers ``EXPERTS_IMPLEMENTATION`` there, whose forward is one ``llm::experts`` call.
The router before it (linear, softmax or sigmoid, top-k, the family's normalisation) and
any shared expert after it are ordinary modules and trace as they are.
"""
from __future__ import annotations

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _default_apply_gate

from mlx_pte.ir.catalog_moe import CLAMPED_SWIGLU

from . import experts_op  # noqa: F401  (registers torch.ops.llm.experts)
from .experts_layout import converted
from .experts_op import ACTIVATIONS
from .hf_errors import CheckpointError

EXPERTS_IMPLEMENTATION = "mlx_pte"


def _activation_name(module: torch.nn.Module) -> str:
    name = getattr(module.config, "hidden_act", None)
    if name not in ACTIVATIONS:
        raise CheckpointError(
            f"{type(module).__name__} gates its experts with {name!r}; only {', '.join(ACTIVATIONS)} export"
        )
    return name


def experts_forward(
    module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """HF's experts contract: hidden ``[S, H]``, index/weights ``[S, k]`` -> ``[S, H]``."""
    name = type(module).__name__
    clamped = converted(module)
    if clamped is not None:  # gpt-oss, already in the op's layout (experts_layout)
        return torch.ops.llm.experts(
            hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype), module.gate_up_proj,
            module.down_proj, CLAMPED_SWIGLU, module.gate_up_proj_bias, module.down_proj_bias, *clamped,
        )  # fmt: skip
    layout = (module.has_gate, module.has_bias, module.is_transposed, module.is_concatenated)
    if layout != (True, False, False, True) or type(module)._apply_gate is not _default_apply_gate:
        raise CheckpointError(
            f"{name} stores its experts as (gated, biased, transposed, concatenated) = {layout} "
            "with its own gate; only gated, bias-free [gate; up] experts and gpt-oss's export"
        )
    num_experts = module.gate_up_proj.shape[0]
    if module.down_proj.shape[0] != num_experts or module.gate_up_proj.shape[1] != 2 * module.down_proj.shape[2]:
        raise CheckpointError(
            f"{name}'s gate_up_proj {tuple(module.gate_up_proj.shape)} and down_proj "
            f"{tuple(module.down_proj.shape)} do not describe the same experts"
        )
    return torch.ops.llm.experts(
        hidden_states,
        top_k_index,
        top_k_weights.to(hidden_states.dtype),
        module.gate_up_proj,
        module.down_proj,
        _activation_name(module),
    )


ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, experts_forward)


def route_experts(model: torch.nn.Module) -> None:
    """Run ``model``'s experts modules (if any) through ``llm::experts``.

    Raises:
        CheckpointError: the config's top-k does not fit its expert count (HF loads such a
            config without complaint; an expert count unlike the weights' fails HF's load).
    """
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "has_gate")]
    if not experts:
        return
    text = model.config.get_text_config()
    configured = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None)
    if not isinstance(top_k, int) or not 1 <= top_k <= configured:
        raise CheckpointError(
            f"the config routes each token to num_experts_per_tok={top_k!r} experts of {configured}; "
            f"set it to an integer in [1, {configured}]"
        )
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
