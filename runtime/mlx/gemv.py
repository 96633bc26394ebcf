"""One row times a weight, ``x @ weight.T``, in one CUDA kernel built for bandwidth.

At batch 1 a decode step is mostly GEMVs (on Llama-3.2-1B, 65 a token and two thirds of
the step's kernel time), each reading a whole weight once, so their speed is the memory
bandwidth they reach. MLX's ``gemv_single`` has each lane load 4 elements (8 bytes of
bf16) per iteration of a loop whose bound is a run-time value; this kernel has each lane
load 16 bytes per load, with the row length a compile-time constant so the loop unrolls
and several loads per lane are in flight at once.

The same kernel may first build its row: ``norm_gemv`` normalizes it (after a residual add)
in shared memory, so a decoder layer's add, norm and projection are one kernel
(``ir/norm_linears.py`` makes them one op at load); ``glu_gemv`` builds act(gate) * up, so
the MLP's GLU and down projection are one (``ir/glu_linears.py``). The weight may also be
MLX's 4-bit affine packing (``Packed4``; MLX's ``qmv`` loads 8 bytes a lane per pass of a
run-time loop, as its ``gemv_single`` does). The kernels are off unless ``MLX_PTE_GEMV=1``
(see ``enabled``). Their CUDA source, and how it lays rows over the GPU, is
``gemv_source.py``'s (the rows they build, ``gemv_rows.py``'s); this module says where they
run and launches them.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Callable, Optional, Union

from mlx_pte.runtime.mlx.bootstrap import mx
from mlx_pte.runtime.mlx.gemv_rows import GLU_ACTIVATIONS
from mlx_pte.runtime.mlx.gemv_source import HEADER, kernel_source

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# The fused norm and GLU stage the row in static shared memory (CUDA allows 48 KB a block): rows
# of up to 32 KB leave room for the block's other shared arrays.
STAGED_BYTES = 32 * 1024


@dataclass(frozen=True)
class Tiling:
    """How the kernel lays rows over the GPU: warps per block, rows per group of ``split``
    warps (which share each row's loads), and how many 16-byte loads of a lane's loop the
    compiler unrolls."""

    warps: int = 8
    rows: int = 1
    unroll: int = 4
    split: int = 1

    def __post_init__(self) -> None:
        if min(self.warps, self.rows, self.unroll, self.split) < 1 or self.warps > 32 or self.warps % self.split:
            raise ValueError(f"a tiling needs 1-32 warps, whole groups of split warps and positive sizes, got {self}")

    @classmethod
    def parse(cls, text: str) -> "Tiling":
        """``WARPSxROWSxUNROLL`` or ``WARPSxROWSxUNROLLxSPLIT``, as the benchmarks take them."""
        sizes = text.split("x")
        if len(sizes) not in (3, 4) or not all(size.isdigit() for size in sizes):
            raise ValueError(f"a tiling is WARPSxROWSxUNROLL[xSPLIT] (say 8x1x4x2), got {text!r}")
        return cls(*(int(size) for size in sizes))

    def __str__(self) -> str:
        return f"{self.warps}x{self.rows}x{self.unroll}x{self.split}"

    @property
    def rows_per_block(self) -> int:
        """Output rows a block computes: ``rows`` for each group of ``split`` warps."""
        return self.warps // self.split * self.rows

    def template(self) -> list[tuple[str, int]]:
        """The kernel's template arguments for this tiling."""
        return [("WARPS", self.warps), ("ROWS", self.rows), ("UNROLL", self.unroll), ("SPLIT", self.split)]


@dataclass(frozen=True)
class Packed4:
    """A weight [out, in] quantized by MLX's affine mode at 4 bits: ``weight`` uint32
    [out, in / 8], ``scales`` and ``biases`` [out, in / group_size]."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1] * 8

    def fits(self, dtype: mx.Dtype) -> bool:
        """Whether the kernel reads these parts for a row of ``dtype``: groups of whole
        16-byte chunks (32 values), scales and biases of the row's dtype, one per group."""
        out_features, in_features = self.shape
        groups = (out_features, in_features // self.group_size) if self.group_size > 0 else None
        return (
            self.weight.dtype == mx.uint32
            and self.weight.ndim == 2
            and self.group_size % 32 == 0
            and in_features % self.group_size == 0
            and self.scales.shape == self.biases.shape == groups
            and self.scales.dtype == self.biases.dtype == dtype
        )


Weight = Union[mx.array, Packed4]

# Off unless MLX_PTE_GEMV=1. On three H100 hosts whose encoding bounds a Llama-3.2-1B decode
# step, they cut its kernel time but barely its wall time (bench/gpu_suite.sh gemv_forms,
# four runs: 0.99-1.05x bf16, 1.01-1.08x q4), and each kernel's first use compiles it (about
# 2.5 s); they go on by default once a GPU-bound host shows them ahead. The bench also
# switches them in-process (enabled: every kernel; norm_enabled: the fused norm only;
# glu_enabled: the fused GLU only) to time MLX's ops in the same run.
enabled = os.environ.get("MLX_PTE_GEMV") == "1"
norm_enabled = True
glu_enabled = True
tiling = Tiling()
# Asked once: the checks run on every linear of a traced step.
_ON_CUDA = mx.cuda.is_available()
_kernels: dict[tuple[bool, str], Callable] = {}


def _kernel(packed: bool, row: str) -> Callable:
    if (packed, row) not in _kernels:
        spec = kernel_source(packed, row)
        _kernels[packed, row] = mx.fast.cuda_kernel(
            name=spec.name, input_names=list(spec.inputs), output_names=list(spec.outputs), source=spec.source,
            header=HEADER, ensure_row_contiguous=False)
    return _kernels[packed, row]


def _one_row_here(x: mx.array) -> bool:
    """The kernels on, CUDA the default device, and x one row (any leading axes of size 1)
    of a floating dtype."""
    return (enabled and _ON_CUDA and mx.default_device() == mx.gpu and x.ndim >= 1 and x.dtype in DTYPES
            and x.size == x.shape[-1] > 0)


def _weight_fits(weight: Weight, dtype: mx.Dtype, in_features: int) -> bool:
    """A 2-D weight of ``dtype`` (or 4-bit parts that ``Packed4.fits`` it) of ``in_features``
    columns and at least one row."""
    fits = weight.fits(dtype) if isinstance(weight, Packed4) else weight.ndim == 2 and weight.dtype == dtype
    return fits and weight.shape[0] > 0 and weight.shape[1] == in_features


def available(x: mx.array, weight: Weight) -> bool:
    """Whether ``gemv`` runs ``x @ weight.T`` on this process's default device: the kernels
    on, CUDA, one row of x of a floating dtype, and a weight of that dtype and x's width."""
    return _one_row_here(x) and _weight_fits(weight, x.dtype, x.shape[-1])


def glu_available(gate: mx.array, up: Optional[mx.array], width: int, activation: str, weight: Weight) -> bool:
    """Whether ``glu_gemv`` runs these operands here: ``available``'s rules for the GLU's
    row (``width`` features; gate and up of one shape and dtype, or up None and gate both
    halves), an activation the kernel knows, and a row that fits the block's shared memory."""
    return (
        glu_enabled
        and activation in GLU_ACTIVATIONS
        and _one_row_here(gate)
        and (up is None and gate.shape[-1] >= 2 * width
             or up is not None and up.shape == gate.shape == (*gate.shape[:-1], width) and up.dtype == gate.dtype)
        and width * gate.itemsize <= STAGED_BYTES
        and _weight_fits(weight, gate.dtype, width)
    )


def norm_available(x: mx.array, norm_weight: mx.array, weight: Weight, residual: Optional[mx.array] = None) -> bool:
    """Whether ``norm_gemv`` runs these operands here: ``available``'s rules, a norm weight
    (and residual) of x's shape and dtype, and a row that fits the block's shared memory."""
    return (
        norm_enabled
        and available(x, weight)
        and x.shape[-1] * x.itemsize <= STAGED_BYTES
        and norm_weight.shape == (x.shape[-1],)
        and norm_weight.dtype == x.dtype
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype))
    )


def _call(row_kind: str, inputs: list[mx.array], weight: Weight, extra: list, layout: Optional[Tiling],
          outputs: int = 1) -> list[mx.array]:
    """The kernel with ``row_kind``'s row over ``weight`` and ``inputs`` (the operand the row
    is built from first: its dtype and leading axes are the result's)."""
    row = inputs[0]
    layout = layout or tiling
    out_features, in_features = weight.shape
    packed = isinstance(weight, Packed4)
    parts = [weight.weight, weight.scales, weight.biases] if packed else [weight]
    group = [("GROUP", weight.group_size)] if packed else []
    blocks = -(-out_features // layout.rows_per_block)
    # Leading axes of the row are all 1, so the flat rows the kernel writes are this shape.
    shapes = [(*row.shape[:-1], out_features), row.shape][:outputs]
    return _kernel(packed, row_kind)(
        inputs=[*parts, *inputs],
        template=[("T", row.dtype), ("OUT", out_features), ("IN", in_features), *layout.template(), *group, *extra],
        grid=(blocks * 32 * layout.warps, 1, 1),
        threadgroup=(32 * layout.warps, 1, 1),
        output_shapes=shapes,
        output_dtypes=[row.dtype] * outputs,
    )


def gemv(x: mx.array, weight: Weight, layout: Optional[Tiling] = None) -> mx.array:
    """``x @ weight.T`` for one row x ([..., in], leading axes of size 1) and weight
    [out, in] (dense, or its 4-bit parts); the result has x's leading axes and ``out``
    last, in x's dtype."""
    return _call("input", [x], weight, [], layout)[0]


def glu_gemv(gate: mx.array, up: Optional[mx.array], width: int, activation: str, weight: Weight,
             layout: Optional[Tiling] = None) -> mx.array:
    """``glu(gate, up) @ weight.T``, act(gate) * up of ``width`` features, in one kernel
    (``glu_available`` says where). With up None, gate is a fused gate/up row: its first
    ``width`` features the gate, its last ``width`` the up."""
    up_at = 0 if up is not None else gate.shape[-1] - width
    # One operand twice where gate and up are halves of it: no slice node, the kernel indexes.
    return _call(f"{activation}_glu", [gate, gate if up is None else up], weight, [("UP_AT", up_at)], layout)[0]


def norm_gemv(x: mx.array, norm_weight: mx.array, eps: float, weight: Weight,
              residual: Optional[mx.array] = None, layout: Optional[Tiling] = None) -> tuple[mx.array, mx.array]:
    """``rms_norm(h, norm_weight, eps) @ weight.T`` and ``h``, where h is ``x + residual``
    (rounded to x's dtype) or x itself: one kernel (``norm_available`` says where)."""
    eps_bits = struct.unpack("<i", struct.pack("<f", eps))[0]  # the kernel reads it back as a float
    if residual is None:
        return _call("norm", [x, norm_weight], weight, [("EPS", eps_bits)], layout)[0], x
    y, total = _call("add_norm", [x, residual, norm_weight], weight, [("EPS", eps_bits)], layout, outputs=2)
    return y, total
