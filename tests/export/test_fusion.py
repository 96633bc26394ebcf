"""Lowering-time fusion (export/fusion*.py): HF-style RMSNorm, rotary-embedding and gated
MLP chains lower to one ``rms_norm`` / ``rope`` (``rope_half``) / ``glu`` instruction in
every dtype, near misses lower op by op, and either way the program matches eager torch
(export_module → .pte → load → run)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch import nn
from torch.export import Dim

import mlx_pte.runtime.mlx.blas  # noqa: F401
import mlx.core as mx

from mlx_pte.interpreter.rope_handlers import rope_fast, rope_from_table

from . import hf_blocks
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


# -- HF's own layers, in every dtype ---------------------------------------------------
# Relative to max(|ref|, 1), against eager torch in the same dtype. Fused ops round where
# torch rounds, so the differences are reduction order and transcendental ulps.
TOLERANCE = {torch.float32: FP32, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = list(TOLERANCE)
# Unfused chains run op by op in half precision (test_op_parity.py's measured bounds).
UNFUSED_TOLERANCE = {torch.float32: FP32, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _mx_input(x: torch.Tensor):
    """numpy has no bfloat16: half inputs go in as MLX arrays of the same values."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return mx.array(x.float().numpy()).astype(mx.float16 if x.dtype == torch.float16 else mx.bfloat16)
    return x.numpy()


def _positions(t: int) -> torch.Tensor:
    """Token positions as a batched step packs them: runs of several sequences, not one range."""
    return torch.randint(0, 300, (t,), generator=_GEN)


class CustomNorm(nn.Module):
    """LlamaRMSNorm's chain with knobs that break one precondition each."""

    def __init__(self, upcast: bool = True, eps_in_mean: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(hf_blocks.HIDDEN, generator=_GEN) + 0.5)
        self.upcast, self.eps_in_mean = upcast, eps_in_mean

    def forward(self, x):
        h = x.float() if self.upcast else x
        ms = (h.pow(2) + 1e-6).mean(-1, keepdim=True) if self.eps_in_mean else h.pow(2).mean(-1, keepdim=True) + 1e-6
        return self.weight * (h * torch.rsqrt(ms)).to(x.dtype)


class LeakyGLU(nn.Module):
    def forward(self, gate, up):
        act = torch.nn.functional.silu(gate)
        return act * up, act


def _hidden(t: int, dtype: torch.dtype) -> tuple:
    return (_rand(1, t, hf_blocks.HIDDEN).to(dtype) * 2,)


def _qk(t: int, dtype: torch.dtype, seq_axis: int = 2) -> tuple:
    shape = [1, hf_blocks.HEADS, hf_blocks.HEADS, hf_blocks.HEAD_DIM]
    shape[seq_axis] = t
    return _rand(*shape).to(dtype), _rand(*shape).to(dtype), _positions(t)


def _qk_token_major(t: int, dtype: torch.dtype) -> tuple:
    return _qk(t, dtype, seq_axis=1)


def _gate_up(t: int, dtype: torch.dtype) -> tuple:
    return _rand(1, t, 48).to(dtype) * 3, _rand(1, t, 48).to(dtype)


HIDDEN_DYNAMIC = ({1: _T},)
QK_DYNAMIC = ({2: _T}, {2: _T}, {0: _T})
GATE_UP_DYNAMIC = ({1: _T}, {1: _T})
_NORM_OPS = {"pow", "mean", "rsqrt"}

# name -> (module, inputs (t, dtype), dynamic shapes, ops that must appear (counts), ops that must not)
HF_CASES: dict[str, tuple] = {
    **{f"norm_{kind}": (lambda kind=kind: hf_blocks.Norm(kind), _hidden, HIDDEN_DYNAMIC, {"rms_norm": 1},
                        _NORM_OPS | {"cast", "mul"}) for kind in hf_blocks.Norm.KINDS},  # fmt: skip
    "rotary": (hf_blocks.Rotary, _qk, QK_DYNAMIC, {"rope": 2}, {"rope_half", "cos", "sin", "cat", "neg"}),
    "rotary_token_major": (lambda: hf_blocks.Rotary(seq_axis=1), _qk_token_major, ({1: _T}, {1: _T}, {0: _T}),
                           {"rope": 2}, {"rope_half", "cos", "sin", "cat", "neg"}),  # fmt: skip
    # Tables scaled by an attention factor: the factor becomes rope's table_scale.
    "rotary_scaled": (lambda: hf_blocks.Rotary(attention_scaling=0.5), _qk, QK_DYNAMIC, {"rope": 2},
                      {"rope_half", "cos", "sin", "cat", "neg"}),  # fmt: skip
    # gpt-oss's form: chunked halves and half-width tables, YaRN-scaled, or unscaled.
    "rotary_chunk_yarn": (hf_blocks.ChunkRotary, _qk, QK_DYNAMIC, {"rope": 2},
                          {"rope_half", "cos", "sin", "cat", "split", "sub"}),  # fmt: skip
    "rotary_chunk_plain": (lambda: hf_blocks.ChunkRotary({"rope_type": "default", "rope_theta": 10000.0}), _qk,
                           QK_DYNAMIC, {"rope": 2}, {"rope_half", "cos", "sin", "cat", "split", "sub"}),  # fmt: skip
    "rotary_chunk_token_major": (lambda: hf_blocks.ChunkRotary(seq_axis=1), _qk_token_major,
                                 ({1: _T}, {1: _T}, {0: _T}), {"rope": 2}, {"rope_half", "cos", "sin", "cat"}),  # fmt: skip
    # gate and up are fused into one projection at export, which the glu reads whole.
    "swiglu": (hf_blocks.GatedMLP, _hidden, HIDDEN_DYNAMIC, {"glu": 1, "linear": 2}, {"silu", "mul", "split"}),
    "geglu": (lambda: hf_blocks.GatedMLP("gelu_pytorch_tanh"), _hidden, HIDDEN_DYNAMIC, {"glu": 1}, {"gelu", "mul"}),
    "block": (hf_blocks.Block, lambda t, d: (*_hidden(t, d), _positions(t)), ({1: _T}, {0: _T}),
              # q/k/v fused at export: one split_heads for the three head splits.
              {"rms_norm": 1, "rope": 2, "split_heads": 1, "permute_view": 1, "glu": 1},
              _NORM_OPS | {"view", "permute", "view_permute", "split", "cos", "neg"}),  # fmt: skip
}
# Near misses: each breaks one precondition and must lower op by op.
NEAR_MISSES = {
    "norm_eps_in_mean": (lambda: CustomNorm(eps_in_mean=True), _hidden, HIDDEN_DYNAMIC, {"rsqrt": 1}, {"rms_norm"}),
    "glu_activation_leaked": (LeakyGLU, _gate_up, GATE_UP_DYNAMIC, {"silu": 1, "mul": 1}, {"glu"}),
}
HF_CASES.update(NEAR_MISSES)


# fp32 and bf16 in the fast tier; fp16 (~10 s over every case) in the slow tier.
@pytest.mark.parametrize(
    "dtype", [pytest.param(d, marks=pytest.mark.slow) if d == torch.float16 else d for d in DTYPES], ids=str
)
@pytest.mark.parametrize("name", list(HF_CASES))
def test_hf_fusion_matches_eager(tmp_path, name, dtype):
    make_module, make_inputs, dynamic, present, absent = HF_CASES[name]
    module = hf_blocks.in_dtype(make_module(), dtype)
    program = export_and_load(module, make_inputs(5, dtype), tmp_path / f"{name}.pte", dynamic)
    ops = Counter(instr.op for instr in program.graph.instructions)
    assert {op: ops[op] for op in present} == present, ops
    assert not absent & set(ops), ops
    for t in (5, 1, 13):
        inputs = make_inputs(t, dtype)
        with torch.no_grad():
            expected = module(*inputs)
        expected = expected if isinstance(expected, tuple) else (expected,)
        tolerance = (UNFUSED_TOLERANCE if name in NEAR_MISSES else TOLERANCE)[dtype]
        assert_matches(program.run([_mx_input(x) for x in inputs]), expected, tolerance)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_norm_computed_in_half_precision_is_not_fused(tmp_path, dtype):
    """Without the upcast the chain rounds every op to half precision; rms_norm computes in
    fp32, which would be a numeric change."""
    module = hf_blocks.in_dtype(CustomNorm(upcast=False), dtype)
    program = export_and_load(module, _hidden(5, dtype), tmp_path / "half_norm.pte", HIDDEN_DYNAMIC)
    ops = Counter(instr.op for instr in program.graph.instructions)
    assert "rms_norm" not in ops and ops["rsqrt"] == 1, ops
    inputs = _hidden(7, dtype)
    with torch.no_grad():
        assert_matches(program.run([_mx_input(x) for x in inputs]), (module(*inputs),), UNFUSED_TOLERANCE[dtype])


def test_a_weight_of_another_dtype_stays_outside_the_norm(tmp_path):
    """A fp32 weight times the bf16-rounded value promotes to fp32, which is not rms_norm's
    rounding: only the weightless part (normalize, round to bf16) fuses; the upcast and the
    fp32 multiply stay."""
    module = hf_blocks.in_dtype(CustomNorm(), torch.bfloat16)
    module.weight.data = module.weight.data.float()
    program = export_and_load(module, _hidden(5, torch.bfloat16), tmp_path / "mixed.pte", HIDDEN_DYNAMIC)
    ops = Counter(instr.op for instr in program.graph.instructions)
    assert ops == {"rms_norm": 1, "cast": 1, "mul": 1}, ops
    norm = next(i for i in program.graph.instructions if i.op == "rms_norm")
    assert norm.inputs[1] is None and norm.attr("dtype") is None
    inputs = _hidden(6, torch.bfloat16)
    with torch.no_grad():
        assert_matches(program.run([_mx_input(x) for x in inputs]), (module(*inputs),), FP32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seq_axis", [2, 1])
@pytest.mark.parametrize("rope", [rope_from_table, rope_fast], ids=["table", "fast"])
@pytest.mark.parametrize("block", [hf_blocks.Rotary, hf_blocks.ChunkRotary], ids=["default", "yarn_scaled"])
def test_both_rope_paths_match_hf(block, rope, seq_axis, dtype):
    """The GPU path (mx.fast.rope, one offset per token) is MLX's own CPU fallback here:
    the same arithmetic as its kernels, so the token-on-batch-axis layout is what is tested.
    YaRN's tables carry an attention factor (``table_scale``)."""
    rotary = hf_blocks.in_dtype(block(seq_axis=seq_axis), dtype)
    table_scale = rotary.rotary.attention_scaling
    assert (table_scale == 1.0) == (block is hf_blocks.Rotary)
    for t in (1, 9):
        q, k, positions = _qk(t, dtype, seq_axis)
        with torch.no_grad():
            expected, _ = rotary(q, k, positions)
        inv_freq = mx.array(rotary.rotary.inv_freq.numpy())
        got = rope(mx.array(_mx_input(q)), mx.array(positions.numpy()), inv_freq, seq_axis, table_scale=table_scale)
        assert_matches([got], [expected], TOLERANCE[dtype])


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}  # fmt: skip


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["plain", "llama3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_load_time_rope_form_matches_hf_and_needs_no_per_call_reciprocal(scaling, dtype):
    """``rope_form`` picks the kernel's base form for plain RoPE and precomputed reciprocals
    otherwise (scaled, or a table rounded off the base form); either, used from a compiled function as capture does, matches HF."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from mlx_pte.interpreter.rope_handlers import rope_form

    rotary = hf_blocks.Rotary()
    rotary.rotary = LlamaRotaryEmbedding(type(hf_blocks.CONFIG)(**{**hf_blocks.CONFIG.to_dict(), "rope_scaling": scaling}))
    rotary = hf_blocks.in_dtype(rotary, dtype)
    form = rope_form(mx.array(rotary.rotary.inv_freq.numpy()))
    # in_dtype rounds a half-precision block's table to that dtype: no longer the base form.
    assert list(form) == (["base"] if scaling is None and dtype == torch.float32 else ["freqs"])
    compiled = mx.compile(lambda x, pos, inv: rope_fast(x, pos, inv, 2, **form))
    for t in (1, 9):
        q, k, positions = _qk(t, dtype)
        with torch.no_grad():
            expected, _ = rotary(q, k, positions)
        args = (mx.array(_mx_input(q)), mx.array(positions.numpy()), mx.array(rotary.rotary.inv_freq.numpy()))
        got = rope_fast(*args, 2, **form)
        # The kernel's fp32 angle from reciprocals (1 / freqs) is an ulp or two off HF's
        # product, which at positions in the hundreds reaches ~2e-5 of the output.
        assert_matches([got], [expected], max(TOLERANCE[dtype], 3e-5))
        # Compiled (the form's arrays captured as constants), the CPU fallback's ops fuse
        # and may round differently: within the half-precision tolerance of the eager call.
        np.testing.assert_allclose(np.array(compiled(*args).astype(mx.float32)),
                                   np.array(got.astype(mx.float32)), rtol=1e-2, atol=1e-2)  # fmt: skip
