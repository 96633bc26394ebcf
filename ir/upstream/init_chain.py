"""Upstream's init chain, folded into constants at import.

Upstream's runtime runs a program's init chain once at load, on the constants only; its
exporter emits one there for each quantized weight stored "scale only" (zero point 0):
the affine biases, ``scales * -2**(bits - 1)``, written over a placeholder constant
(``emit_quantized_biases`` in upstream's ``builder/op_helpers.py``). Computing them here
makes them ordinary stored parts of the quantized weight (``ir.quantization``).

The products are exactly MLX's: a product of two float16 or bfloat16 values is exact in
float32, so rounding it once to the dtype gives the correctly rounded product MLX computes
(float32 and integer products are numpy's, IEEE and wrapping as MLX's).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import FormatError
from ..graph import SlotKind, TensorType
from .builder import ImportBuilder

_NUMPY = {
    "float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32,
    "int16": np.int16, "int8": np.int8, "uint8": np.uint8, "uint32": np.uint32, "bool": np.bool_,
}  # fmt: skip
_FOLDED: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {"MultiplyNode": np.multiply}
FOLDABLE = tuple(_FOLDED)


def fold_init_chain(
    builder: ImportBuilder, instructions: list[tuple[str, Any]], weights: dict[int, memoryview], inputs: range
) -> None:
    """Evaluate each ``(node type name, node)`` of the init chain on the constants; each result
    becomes a new constant slot (its bytes added to ``weights``) that the tensor it writes holds.

    Raises:
        FormatError: a node type that cannot be folded, an operand that is not a constant,
            operands of two dtypes, or a result written over an input or out of range.
    """
    for name, node in instructions:
        fold = _FOLDED.get(name)
        if fold is None:  # _check_node_types reports these first; this guards direct callers
            raise FormatError(f"the upstream init chain holds a {name}; mlx-pte folds only {', '.join(FOLDABLE)}")
        a, b = builder.read(node.a), builder.read(node.b)
        dtypes = {builder.constant_dtype(a), builder.constant_dtype(b)}
        if None in dtypes:
            raise FormatError("the upstream init chain computes on a value that is not a constant")
        if len(dtypes) != 1:
            raise FormatError(f"the upstream init chain multiplies {' by '.join(sorted(dtypes))}; mlx-pte folds one dtype")
        (dtype,) = dtypes
        try:
            with np.errstate(all="ignore"):  # overflow to inf and nan products are MLX's too
                value = fold(*(_array(weights[s], builder.graph.slots[s].type) for s in (a, b)))
        except ValueError as exc:  # shapes that do not broadcast
            raise FormatError(f"the upstream init chain's {name} cannot be computed: {exc}") from None
        out = node.out
        if out is None or not 0 <= out.idx < builder.n_tensors or out.idx in inputs:
            raise FormatError(f"the upstream init chain writes tensor {None if out is None else out.idx}, "
                              "which is an input or out of range")  # fmt: skip
        slot = builder.graph.add_slot(f"init_t{out.idx}", SlotKind.CONSTANT, TensorType(dtype, value.shape))
        weights[slot] = memoryview(_to_bytes(value, dtype))
        builder.bind(out.idx, slot)


def _array(data: memoryview, t: TensorType) -> np.ndarray:
    """A constant's values; bfloat16 widened to float32 (exactly)."""
    if t.dtype == "bfloat16":
        bits = np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(t.shape)
    return np.frombuffer(data, dtype=_NUMPY[t.dtype]).reshape(t.shape)


def _to_bytes(value: np.ndarray, dtype: str) -> bytes:
    if dtype != "bfloat16":
        return np.ascontiguousarray(value, dtype=_NUMPY[dtype]).tobytes()
    bits = np.ascontiguousarray(value, dtype=np.float32).view(np.uint32)
    nan = np.isnan(value)
    # Round to nearest, ties to even, on the 16 bits kept.
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    rounded = np.where(nan, np.uint32(0x7FC0), rounded).astype(np.uint16)
    return rounded.tobytes()
