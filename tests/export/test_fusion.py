"""Lowering-time fusion (export/fusion.py): HF-style RMSNorm and rotary-embedding chains
lower to one ``rms_norm`` / ``rope_half`` instruction, near misses lower op by op, and
either way the program matches eager torch (export_module → .pte → load → run)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from torch.export import Dim

from .roundtrip import assert_matches, export_and_load

FP32 = 1e-5
_GEN = torch.Generator().manual_seed(0)


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_GEN)


class HFRMSNorm(nn.Module):
    """LlamaRMSNorm's arithmetic (fp32), with knobs that break the pattern."""

    def __init__(self, size: int = 8, power: float = 2, dim: int = -1, leak: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(size, generator=_GEN) + 0.5)
        self.power, self.dim, self.leak = power, dim, leak

    def forward(self, x):
        inv = torch.rsqrt(x.pow(self.power).mean(self.dim, keepdim=True) + 1e-6)
        out = self.weight * (x * inv)
        return (out, inv) if self.leak else out


def _rotate_half(x: torch.Tensor, split: int) -> torch.Tensor:
    return torch.cat((-x[..., split:], x[..., :split]), dim=-1)


class HFRope(nn.Module):
    """apply_rotary_pos_emb on q [1, H, T, D] with cos/sin [1, T, D] (unsqueezed to heads)."""

    def __init__(self, split: int = 4) -> None:
        super().__init__()
        self.split = split

    def forward(self, q, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _rotate_half(q, self.split) * sin


def _norm_inputs(t: int) -> tuple:
    return (_rand(t, 3, 8),)


def _rope_inputs(t: int) -> tuple:
    angles = _rand(1, t, 4).repeat(1, 1, 2)
    return _rand(1, 2, t, 8), angles.cos(), angles.sin()


_T = Dim("T", min=1, max=64)
NORM_DYNAMIC = ({0: _T},)
ROPE_DYNAMIC = ({2: _T}, {1: _T}, {1: _T})

# (module, inputs by size, dynamic shapes, ops that must appear, ops that must not)
CASES = {
    "rms_norm": (HFRMSNorm, _norm_inputs, NORM_DYNAMIC, {"rms_norm": 1}, {"pow", "mean", "rsqrt", "mul"}),
    "rms_norm_power4": (lambda: HFRMSNorm(power=4), _norm_inputs, NORM_DYNAMIC, {"pow": 1, "rsqrt": 1}, {"rms_norm"}),
    "rms_norm_wrong_dim": (lambda: HFRMSNorm(size=1, dim=1), lambda t: (_rand(t, 3, 1),), NORM_DYNAMIC,
                           {"mean": 1, "rsqrt": 1}, {"rms_norm"}),  # fmt: skip
    "rms_norm_leaked": (lambda: HFRMSNorm(leak=True), _norm_inputs, NORM_DYNAMIC, {"rsqrt": 1}, {"rms_norm"}),
    "rope": (HFRope, _rope_inputs, ROPE_DYNAMIC, {"rope_half": 1}, {"cat", "neg", "slice", "mul", "add"}),
    "rope_wrong_split": (lambda: HFRope(split=3), _rope_inputs, ROPE_DYNAMIC, {"cat": 1, "neg": 1}, {"rope_half"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fusion_matches_eager(tmp_path, name):
    make_module, make_inputs, dynamic, present, absent = CASES[name]
    module = make_module().eval()
    program = export_and_load(module, make_inputs(5), tmp_path / f"{name}.pte", dynamic)
    ops = Counter(instr.op for instr in program.graph.instructions)
    assert {op: ops[op] for op in present} == present, ops
    assert not absent & set(ops), ops
    for t in (5, 1, 17):
        inputs = make_inputs(t)
        with torch.no_grad():
            expected = module(*inputs)
        expected = expected if isinstance(expected, tuple) else (expected,)
        assert_matches(program.run([x.numpy() for x in inputs]), expected, FP32)
