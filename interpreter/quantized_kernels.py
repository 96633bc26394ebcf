"""Refuse, at load, a program whose quantized weights this machine's MLX cannot run.

MLX's kernels for the quantized modes differ by device (e.g. a CPU or GPU build may lack
one), and a missing kernel would otherwise surface mid-generation. Each distinct type
``(mode, bits, group_size)`` of a program is run once on a small weight.
"""
from __future__ import annotations

from mlx_pte.runtime.mlx.bootstrap import mx

from mlx_pte.ir.graph import Graph
from mlx_pte.ir.quantization import QuantSpec, quantized_constants

_CHECKED: set[QuantSpec] = set()
_PROBE_K = 256  # a multiple of every group size (some kernels take no fewer columns)


class UnsupportedQuantizationError(ValueError):
    """This machine's MLX has no kernel for a quantized weight type the program uses."""


def check_kernels(graph: Graph) -> None:
    """Raise UnsupportedQuantizationError unless every quantized type of ``graph`` runs here."""
    for spec in {qc.spec for qc in quantized_constants(graph).values()} - _CHECKED:
        kwargs = {"group_size": spec.group_size, "bits": spec.bits, "mode": spec.mode}
        try:
            x = mx.ones((1, _PROBE_K))
            parts = mx.quantize(mx.ones((8, _PROBE_K)), **kwargs)
            biases = parts[2] if spec.affine else None
            mx.eval(
                mx.quantized_matmul(x, parts[0], parts[1], biases, transpose=True, **kwargs),
                mx.dequantize(parts[0], parts[1], biases, dtype=mx.float32, **kwargs),
            )
        except (RuntimeError, ValueError) as exc:
            raise UnsupportedQuantizationError(
                f"MLX {mx.__version__} on {mx.default_device()} cannot run {spec.describe()} weights ({exc}); "
                "export the model with another --quantize type, or run it on a device that supports this one"
            ) from None
        _CHECKED.add(spec)
