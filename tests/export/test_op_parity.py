"""Op-level parity: small modules exported through the real pipeline (export_module →
.pte → load → run) against eager torch on random inputs, static and dynamic shapes.

Each case exports once (module-scoped) and runs at every size listed for it. Together
the cases (and the attention model in test_attention_program.py) emit every catalog op;
``test_cases_cover_the_catalog`` checks that.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import mlx_pte.runtime.mlx.blas  # noqa: F401
import mlx.core as mx

from mlx_pte.ir.catalog import CATALOG, UPSTREAM_ONLY

from . import hf_blocks
from .roundtrip import assert_matches, export_and_load

# Relative to max(|ref|, 1). Measured worst cases: fp32 7.8e-7 (linalg), fp16 8.4e-4,
# bf16 5.3e-3 (HalfBlock, eager torch in the same dtype).
FP32 = 1e-5


@dataclass
class Case:
    module: Callable[[], nn.Module]
    make_inputs: Callable[[int], tuple]  # size of the dynamic dim → inputs
    sizes: tuple[int, ...]  # the first is the export example
    dynamic: Optional[Callable[[], Any]] = None


_GEN = torch.Generator().manual_seed(0)


def _rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_GEN).to(dtype)


class Unary(nn.Module):
    def forward(self, x):
        return (
            -x, x.abs(), x.exp(), (x.abs() + 1).log(), x.abs().sqrt(), (x.abs() + 0.5).rsqrt(),
            x.sin(), x.cos(), x.tanh(), x.sigmoid(), F.relu(x), F.silu(x), torch.erf(x),
            torch.reciprocal(x + 3), F.gelu(x), F.gelu(x, approximate="tanh"),
            x.clamp(-0.5, 0.7), x.clamp(min=0.1), x.to(torch.int32).clamp(max=1),
        )  # fmt: skip


class Binary(nn.Module):
    def forward(self, x, y, z, n):
        return (
            x + y, x + z, torch.sub(x, y, alpha=2), x * y, x / (y.abs() + 1), x.abs() ** y,
            x.abs() ** 2.5, 2.0 ** x, 3 - x, torch.maximum(x, y), torch.minimum(x, z),
            x < y, x <= 0.5, x > z, x >= y, x == x, x != y, n > 1.5, n == 2,
            torch.where(x > 0, x, y), n + x, n * 2, n / 2,
        )  # fmt: skip


class Reduce(nn.Module):
    def forward(self, x, n):
        return (
            x.sum(-1), x.sum(), x.mean((0, 1), keepdim=True), x.mean(), x.amax(0), x.amin(-1, keepdim=True),
            x.argmax(-1), x.argmax(), x.argmax(0, keepdim=True), torch.softmax(x, 0), torch.log_softmax(x, -1),
            n.sum(-1), (x > 0).sum(0),
        )  # fmt: skip


class Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rms = nn.RMSNorm(8, eps=1e-6)
        self.ln = nn.LayerNorm(8)
        self.ln_plain = nn.LayerNorm(8, elementwise_affine=False)
        with torch.no_grad():
            self.rms.weight.uniform_(0.5, 1.5)
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return self.rms(x), F.rms_norm(x, (8,)), self.ln(x), self.ln_plain(x)


class Rope(nn.Module):
    """HF's rotary-embedding arithmetic: export fuses it to one rope_half (export/fusion.py)."""

    def forward(self, q, cos, sin):
        rotated = torch.cat((-q[..., 4:], q[..., :4]), dim=-1)
        return q * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class LinAlg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5)
        self.fc_nobias = nn.Linear(8, 3, bias=False)

    def forward(self, x, w, b3, b4):
        return (
            self.fc(x), self.fc_nobias(x), x @ w, torch.bmm(b3, b3.transpose(1, 2)),
            b4 @ b4.transpose(-1, -2), torch.addmm(self.fc.bias, x, w[:, :5], beta=0.5, alpha=2.0),
        )  # fmt: skip


class Index(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)

    def forward(self, tokens, x, idx, gidx):
        return self.emb(tokens), torch.index_select(x, 1, idx), torch.index_select(x, 0, idx), torch.gather(x, 1, gidx)


class Layout(nn.Module):
    def forward(self, x):
        t = x.shape[0]
        y = x.view(t, 2, 4)
        a, b, c = torch.split(x, [3, 1, 4], dim=1)
        p, q = x.split(4, dim=1)
        return (
            y.permute(2, 0, 1), y.transpose(0, 2), x[:, 1:7:2], x[-2:], x[:, -3], y[1], y.unsqueeze(1), y.unsqueeze(-1),
            y[:, :1].squeeze(1), x.view(t, 1, 8, 1).squeeze(), x.unsqueeze(0).expand(3, -1, -1),
            x[:, :1].expand(t, 5), torch.cat([x, x * 2], 1), torch.cat([x, x.to(torch.float16)], 0), a, b, c, p + q,
            x.reshape(t * 8), x.t(), x.view(1, t, 2, 4).transpose(1, 2) * 1.5,
        )  # fmt: skip


class Create(nn.Module):
    def forward(self, x, n):
        t = x.shape[0]
        return (
            torch.full((t, 3), 2.5), torch.zeros(2, t, dtype=torch.int64), torch.ones_like(x), torch.full_like(n, 7),
            torch.zeros_like(x, dtype=torch.bool), torch.arange(t), torch.arange(1, 9, 3, dtype=torch.int32),
            torch.arange(t, 2 * t), torch.scalar_tensor(1.5), x.to(torch.int64), n.float(), x.to(torch.bfloat16),
        )  # fmt: skip


class SymbolicSizes(nn.Module):
    """Sizes computed from a dynamic dim (host integer ops on sym_size results)."""

    def forward(self, x):
        t = x.shape[0]
        return (
            torch.arange(t - 1), torch.full((t + 1,), 3.0), torch.arange(t // 2), torch.zeros(t // 2 + 1, 3),
            x[: t - 1], x[1 : t - 2], x.reshape(2 * t, 2),
        )  # fmt: skip


class Update(nn.Module):
    """Functionalized in-place updates (slice_scatter, copy), repeat and logical ops."""

    def forward(self, x, y, n):
        t = x.shape[0]
        a = x.clone()
        a[1:] += y[:-1]  # slice_scatter + copy, the pattern of gemma3n's AltUp correction
        b = x.clone()
        b[:, 2:5] = n[:, :1]  # copy broadcasting an int64 source into float32
        c = x.clone()
        c[t - 3 :] = 0.5  # a dynamic start; copy from a 0-d constant
        c[:, 6:] = -1.5  # copy broadcasting into a dynamic shape
        return (
            a, b, c, torch.slice_scatter(x, y[: t - 1], 0, 1), torch.slice_scatter(x, y[:, ::2], 1, 0, None, 2),
            torch.slice_scatter(x, y[:2], 0, -2), x.repeat(2, 1, 3), x[:1].repeat(t, 1),
            torch.logical_and(x > 0, y < 0), torch.logical_or(x.relu(), n), torch.logical_not(x.relu()),
            torch.logical_not(n > 1),
        )  # fmt: skip


class HalfBlock(nn.Module):
    """The ops an LLM block runs, for the half-precision dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(16, eps=1e-5)
        self.up = nn.Linear(16, 32, bias=False)
        self.down = nn.Linear(32, 16)

    def forward(self, x, y):
        h = self.norm(x)
        g = F.silu(self.up(h)) * 0.5
        scores = torch.softmax(h @ h.transpose(0, 1) * 0.25, -1)
        return self.down(g) + y, scores, (x * 2.0 - 1).exp().mean(-1), torch.cat([x, h], 0)[:, ::2]


def _dynamic(*axes: Optional[int], low: int = 1) -> Callable[[], tuple]:
    """dynamic_shapes sharing one dim T in [low, 32] at ``axes[i]`` of input i (None: static)."""

    def build() -> tuple:
        t = Dim("T", min=low, max=32)
        return tuple(None if axis is None else {axis: t} for axis in axes)

    return build


CASES: dict[str, Case] = {
    "unary": Case(Unary, lambda t: (_rand(t, 6),), (4, 1, 9), _dynamic(0)),
    "binary": Case(
        Binary,
        lambda t: (_rand(t, 6), _rand(t, 6), _rand(6), torch.randint(0, 4, (t, 6), generator=_GEN)),
        (5, 1, 12),
        _dynamic(0, 0, None, 0),
    ),
    "reduce": Case(
        Reduce,
        lambda t: (_rand(t, 7), torch.randint(-5, 5, (t, 3), dtype=torch.int32, generator=_GEN)),
        (6, 1, 17),
        _dynamic(0, 0),
    ),
    "norms": Case(Norms, lambda t: (_rand(2, t, 8) * 3,), (5, 1, 11), _dynamic(1)),
    "rope": Case(Rope, lambda t: (_rand(1, 2, t, 8), _rand(1, t, 8), _rand(1, t, 8)), (5, 1, 11), _dynamic(2, 1, 1)),
    "linalg": Case(
        LinAlg,
        lambda t: (_rand(t, 8), _rand(8, 6), _rand(3, t, 4), _rand(2, 3, t, 4)),
        (4, 1, 10),
        _dynamic(0, None, 1, 2),
    ),
    "index": Case(
        Index,
        lambda t: (
            torch.randint(0, 11, (2, t), generator=_GEN), _rand(5, 7),
            torch.tensor([4, 0, 2, 2]), torch.randint(0, 7, (5, 3), generator=_GEN),
        ),  # fmt: skip
        (3, 1, 8),
        _dynamic(1, None, None, None),
    ),
    "layout": Case(Layout, lambda t: (_rand(t, 8),), (4, 2, 13), _dynamic(0, low=2)),
    "create": Case(
        Create,
        lambda t: (_rand(t, 3), torch.randint(0, 9, (t,), generator=_GEN)),
        (3, 1, 7),
        _dynamic(0, 0),
    ),
    # HF's layers: the fused rms_norm, rope, glu (on the fused gate/up), split_heads (of the fused q/k/v) and permute_view (test_fusion.py
    # covers each in every dtype).
    "hf_block": Case(
        hf_blocks.Block,
        lambda t: (_rand(1, t, hf_blocks.HIDDEN), torch.randint(0, 300, (t,), generator=_GEN)),
        (5, 1, 12),
        _dynamic(1, 0),
    ),
    # torch.export needs every derived size >= 2 here, hence T >= 5.
    "symbolic_sizes": Case(SymbolicSizes, lambda t: (_rand(t, 4),), (6, 5, 11), _dynamic(0, low=5)),
    # Derived sizes (t - 1, t - 3) must be >= 2 for torch.export too.
    "update": Case(
        Update,
        lambda t: (_rand(t, 8), _rand(t, 8), torch.randint(0, 3, (t, 8), generator=_GEN)),
        (6, 5, 11),
        _dynamic(0, 0, 0, low=5),
    ),
}

HALF = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """Every case exported once: name → (eager module, program)."""
    root = tmp_path_factory.mktemp("op_parity")
    built = {}

    def get(name: str):
        if name not in built:
            case = CASES[name]
            torch.manual_seed(0)
            module = case.module().eval()
            dynamic = case.dynamic() if case.dynamic else None
            built[name] = (module, export_and_load(module, case.make_inputs(case.sizes[0]), root / f"{name}.pte", dynamic))
        return built[name]

    return get


def _eager(module: nn.Module, inputs: tuple) -> tuple:
    with torch.no_grad():
        out = module(*inputs)
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("name", list(CASES))
def test_op_parity_fp32(programs, name):
    case = CASES[name]
    module, program = programs(name)
    for size in case.sizes:  # the export size, then other sizes of the dynamic dim
        inputs = case.make_inputs(size)
        assert_matches(program.run([x.numpy() for x in inputs]), _eager(module, inputs), FP32)


@pytest.mark.parametrize("dtype", list(HALF), ids=str)
def test_op_parity_half_precision(tmp_path, dtype):
    torch.manual_seed(0)
    module = HalfBlock().to(dtype).eval()
    make = lambda n: (_rand(n, 16, dtype=dtype), _rand(n, 16, dtype=dtype))  # noqa: E731
    program = export_and_load(module, make(5), tmp_path / "half.pte", _dynamic(0, 0)())
    for n in (5, 1, 9):
        inputs = make(n)
        # numpy has no bfloat16: pass MLX arrays built from the (exactly representable) fp32 values.
        mx_inputs = [mx.array(x.float().numpy()).astype(mx.float16 if dtype == torch.float16 else mx.bfloat16)
                     for x in inputs]  # fmt: skip
        assert_matches(program.run(mx_inputs), _eager(module, inputs), HALF[dtype])


def test_cases_cover_the_catalog(programs):
    emitted = set()
    for name in CASES:
        emitted |= {instr.op for instr in programs(name)[1].graph.instructions}
    # update_and_attend needs a cache: test_attention_program.py exercises it. The quantized
    # ops need an export with quantization: test_quantized_program.py exercises them. Only
    # imported upstream programs use UPSTREAM_ONLY: tests/upstream/test_op_suite.py runs them.
    # The experts ops and topk come from an MoE export (tests/interpreter/test_moe.py checks
    # them against HF); all_sum is inserted by sharding at load (test_tensor_parallel.py), the
    # fused norm-linears by ir.norm_linears at load (test_norm_linears.py), the fused
    # glu-linears by ir.glu_linears (test_glu_linears.py).
    elsewhere = {"update_and_attend", "quantized_linear", "quantized_embedding", "experts", "quantized_experts",
                 "topk", "all_sum", "rms_norm_linear", "add_rms_norm_linear", "rms_norm_quantized_linear",
                 "add_rms_norm_quantized_linear", "glu_linear", "glu_quantized_linear"}
    assert set(CATALOG) - emitted == elsewhere | UPSTREAM_ONLY
    assert not emitted & UPSTREAM_ONLY
