"""Export-time weight quantization: which constants of an edge program are quantized, and
their packed parts.

The packing is ``mlx.core.quantize`` itself, run here on the full-precision weights, so
the bytes are MLX's own by construction and the same weights always give the same bytes.

Rule (``plan_quantization``): a constant is quantized when every read of it is as the
weight of a ``linear``, an ``embedding`` or ``llm::experts`` (a tied LM head and its embedding read one
constant, so they share one quantized copy), it is floating point and its rows divide
into groups (``ir.quantization.keep_reason``). A linear or embedding weight that does not
fit stays full precision, and the written file reports it
(``ir.quantization.full_precision_weights``); nothing else is ever quantized.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch.export import ExportedProgram
from torch.fx import Node

from mlx_pte.runtime.mlx.bootstrap import mx

from mlx_pte.ir.graph import TensorType
from mlx_pte.ir.payload import ITEMSIZE
from mlx_pte.ir.quantization import QuantizationError, QuantSpec, keep_reason

from . import experts_op  # noqa: F401  (defines torch.ops.llm.experts)
from .graph_builder import Builder, constant_source, target_key
from .tensor_source import PartSource, SharedResult, TensorSource, row_reader

aten = torch.ops.aten

# op -> index of each weight among its arguments
_WEIGHT_ARG = {aten.linear.default: (1,), aten.embedding.default: (0,), torch.ops.llm.experts.default: (3, 4)}


# Rows quantized at once: bounds the float copy MLX makes of a large weight (an embedding).
_QUANTIZE_BLOCK_BYTES = 64 << 20


@dataclass(frozen=True)
class PackedWeight:
    """One weight's packed parts, computed from ``source`` when the first is written."""

    spec: QuantSpec
    source: TensorSource  # the full-precision weight [N, K] (experts: [E, N, K])

    def parts(self) -> list[tuple[str, TensorType, PartSource]]:
        """(name suffix, type, source) of each stored part: weight, scales, biases."""
        types = [t for t in self.spec.parts(tuple(self.source.shape), self.source.dtype) if t is not None]
        result = SharedResult(lambda: _quantize_blocks(self.source, self.spec), len(types))
        return [
            (suffix, TensorType(t.dtype, t.shape), PartSource(result, i, t.shape, t.dtype))
            for i, (suffix, t) in enumerate(zip(("", ".scales", ".biases"), types))
        ]


def _quantize_blocks(source: TensorSource, spec: QuantSpec) -> list[np.ndarray]:
    """``quantize_weight``'s parts of ``source``, computed a block of rows at a time, each
    block read alone from the checkpoint (``tensor_source.row_reader``) and written into
    the parts' arrays; rows quantize independently, so the bytes are one call's."""
    count = source.shape[0]
    row_bytes = ITEMSIZE[source.dtype] * math.prod(source.shape[1:])
    step = max(1, _QUANTIZE_BLOCK_BYTES // max(1, row_bytes))
    read = row_reader(source)
    parts: list[np.ndarray] = []
    for start in range(0, count, step):
        block = quantize_weight(read(start, min(start + step, count)), spec)
        fields = [block.weight, block.scales] + ([block.biases] if spec.affine else [])
        if not parts:
            parts = [np.empty((count, *f.shape[1:]), f.dtype) for f in fields]
        for part, f in zip(parts, fields):
            part[start : start + f.shape[0]] = f
    return parts


@dataclass(frozen=True)
class QuantizedArrays:
    """One weight's packed parts, as ``mx.quantize`` returned them (numpy, C order)."""

    weight: np.ndarray  # uint32 [N, K * bits / 32]
    scales: np.ndarray
    biases: Optional[np.ndarray]


def _is_weight_read(user: Node, node: Node, absorbed: frozenset[Node]) -> bool:
    positions = _WEIGHT_ARG.get(target_key(user.target), ()) if user.op == "call_function" else ()
    return user not in absorbed and any(len(user.args) > at and user.args[at] is node for at in positions)


def _weight_reads(node: Node, absorbed: frozenset[Node]) -> tuple[bool, bool]:
    """(some read of ``node`` is as a linear/embedding weight, every read is)."""
    reads = [_is_weight_read(user, node, absorbed) for user in node.users]
    return any(reads), all(reads)


def plan_quantization(
    ep: ExportedProgram, spec: Optional[QuantSpec], absorbed: frozenset[Node] = frozenset()
) -> dict[Node, PackedWeight]:
    """The packed parts of every linear / embedding weight of ``ep`` that fits ``spec``.

    Args:
        ep: the edge program being lowered.
        spec: the quantization type; None quantizes nothing.
        absorbed: nodes a fusion lowers (a weight one of them reads stays as it is).

    Returns:
        Weight placeholder → its packed parts. The weights left out are those
        ``ir.quantization.full_precision_weights`` reports.
    """
    packed: dict[Node, PackedWeight] = {}
    if spec is None:
        return packed
    for node in ep.graph.nodes:
        source = constant_source(ep, node) if node.op == "placeholder" else None
        if source is None or not node.users:
            continue
        some, every = _weight_reads(node, absorbed)
        if some and keep_reason(spec, tuple(source.shape), source.dtype, other_reads=not every) is None:
            packed[node] = PackedWeight(spec, source)
    return packed


def add_quantized(b: Builder, node: Node, name: str, packed: PackedWeight) -> None:
    """``node``'s weight as its packed parts: constants ``name``, ``name.scales`` and
    ``name.biases`` (affine only), read by the quantized ops that replace its users."""
    slots = [b.add_constant_bytes(name + suffix, t, a) for suffix, t, a in packed.parts()]
    b.quantized[node] = (packed.spec, *slots, *([None] * (3 - len(slots))))


def check_quantizable(spec: QuantSpec) -> None:
    """Raise QuantizationError now if this machine's MLX cannot quantize to ``spec``."""
    quantize_weight(torch.ones(1, spec.group_size), spec)


def quantize_weight(tensor: torch.Tensor, spec: QuantSpec) -> QuantizedArrays:
    """MLX's packing of a 2-D float weight, or a 3-D experts weight (each expert packed as
    its own 2-D weight), with its own dtype's scales, for affine.

    Raises:
        QuantizationError: this machine's MLX cannot quantize to ``spec``.
    """
    try:
        parts = mx.quantize(_to_mlx(tensor), group_size=spec.group_size, bits=spec.bits, mode=spec.mode)
        mx.eval(parts)
    except (RuntimeError, ValueError) as exc:
        raise QuantizationError(
            f"MLX {mx.__version__} on {mx.default_device()} cannot quantize to {spec.describe()}: {exc}"
        ) from None
    weight, scales, *rest = (_to_numpy(p) for p in parts)
    return QuantizedArrays(weight, scales, rest[0] if spec.affine else None)


def _to_mlx(tensor: torch.Tensor) -> mx.array:
    t = tensor.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return mx.array(t.view(torch.uint16).numpy()).view(mx.bfloat16)
    return mx.array(t.numpy())


def _to_numpy(array: mx.array) -> np.ndarray:
    """The array's bytes as numpy (bfloat16 kept as its uint16 bit patterns)."""
    return np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)
