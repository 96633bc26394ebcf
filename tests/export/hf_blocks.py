"""Small modules built from transformers' own layers (RMSNorm variants, rotary embedding,
gated MLP), so the fusion tests trace exactly the chains HF models produce."""
from __future__ import annotations

import torch
from torch import nn
from transformers import GptOssConfig, LlamaConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb as gpt_oss_apply_rotary_pos_emb
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONFIG = LlamaConfig(
    hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
    intermediate_size=48, rms_norm_eps=1e-6, max_position_embeddings=512,
)  # fmt: skip


def _randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial weights (HF initialises norm weights to ones or zeros), matrices scaled
    to keep activations of order 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.5 * noise if p.dim() == 1 else noise / p.shape[-1] ** 0.5)
    return module


def in_dtype(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` in ``dtype``, rotary inverse frequencies kept in fp32 as HF loads them."""
    module = module.to(dtype)
    for sub in module.modules():
        if isinstance(sub, (LlamaRotaryEmbedding, GptOssRotaryEmbedding)):
            sub.inv_freq = sub.inv_freq.float()
    return module.eval()


class Norm(nn.Module):
    """One HF RMSNorm of the given kind over x [1, T, HIDDEN]."""

    KINDS = ("llama", "gemma", "gemma3n", "gemma3n_no_scale")

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.norm = {
            "llama": lambda: LlamaRMSNorm(HIDDEN, eps=1e-6),
            "gemma": lambda: Gemma3RMSNorm(HIDDEN, eps=1e-6),
            "gemma3n": lambda: Gemma3nRMSNorm(HIDDEN, eps=1e-6),
            "gemma3n_no_scale": lambda: Gemma3nRMSNorm(HIDDEN, eps=1e-6, with_scale=False),
        }[kind]()
        _randomize(self)

    def forward(self, x):
        return self.norm(x)


class Rotary(nn.Module):
    """HF's rotary embedding applied to q and k at the given token positions: q [1, H, T, D]
    (``seq_axis`` 2, Llama) or [1, T, H, D] (``seq_axis`` 1, Gemma3n)."""

    def __init__(self, attention_scaling: float = 1.0, seq_axis: int = 2) -> None:
        super().__init__()
        self.rotary = LlamaRotaryEmbedding(CONFIG)
        self.rotary.attention_scaling = attention_scaling
        self.seq_axis = seq_axis

    def forward(self, q, k, positions):
        cos, sin = self.rotary(q, positions.unsqueeze(0))
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=3 - self.seq_axis)


# gpt-oss's YaRN as shipped (factor 32 over an original context of 16 here): its tables
# are scaled by the attention factor 0.1 ln(32) + 1.
YARN = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=16, rope_theta=150000.0)  # fmt: skip


class ChunkRotary(nn.Module):
    """gpt-oss's rotary embedding (half-width tables, ``torch.chunk`` halves) on q and k."""

    def __init__(self, rope_parameters: dict = YARN, seq_axis: int = 2) -> None:
        super().__init__()
        config = GptOssConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                              head_dim=HEAD_DIM, max_position_embeddings=512, rope_parameters=rope_parameters)  # fmt: skip
        self.rotary = GptOssRotaryEmbedding(config)
        self.seq_axis = seq_axis

    def forward(self, q, k, positions):
        cos, sin = self.rotary(q, positions.unsqueeze(0))
        return gpt_oss_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=3 - self.seq_axis)


class GatedMLP(nn.Module):
    def __init__(self, act: str = "silu") -> None:
        super().__init__()
        self.mlp = _randomize(LlamaMLP(LlamaConfig(**{**CONFIG.to_dict(), "hidden_act": act})))

    def forward(self, x):
        return self.mlp(x)


class Block(nn.Module):
    """A decoder layer's ops without attention: norm, head split, rotary, head merge, MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = LlamaRMSNorm(HIDDEN, eps=1e-6)
        self.q = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.rotary = LlamaRotaryEmbedding(CONFIG)
        self.mlp = LlamaMLP(CONFIG)
        _randomize(self)

    def forward(self, x, positions):
        h = self.norm(x)
        t = x.shape[1]
        q = self.q(h).view(1, t, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k(h).view(1, t, HEADS, HEAD_DIM).transpose(1, 2)
        cos, sin = self.rotary(q, positions.unsqueeze(0))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        merged = (q + k).transpose(1, 2).reshape(1, t, HIDDEN)
        return q, self.mlp(merged) + x
