"""Imported MoE matmuls: a ``gather_qmm`` whose quantization MLX does not have is one
FormatError at load, and its possible neighbour validates. (Their values are checked
against eager torch by upstream's op-suite cases, tests/upstream/test_op_suite.py.)"""
from __future__ import annotations

import pytest

from mlx_pte.ir.catalog import validate_graph
from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.graph import Graph, Instruction, SlotKind, TensorType


def _gather_qmm(**quant) -> Graph:
    """x [2, 1, 1, 64] @ 4 experts' 4-bit [128, 64] weights, picked by indices [2]."""
    g = Graph()
    shapes = (("x", "float32", (2, 1, 1, 64)), ("w", "uint32", (4, 128, 8)), ("scales", "float32", (4, 128, 2)),
              ("biases", "float32", (4, 128, 2)), ("indices", "int32", (2,)))  # fmt: skip
    x, w, s, b, idx = (g.add_slot(n, SlotKind.INPUT, TensorType(d, shape)) for n, d, shape in shapes)
    g.inputs = [x, w, s, b, idx]
    out = g.add_slot("out", SlotKind.TEMP, TensorType("float32", (2, 1, 1, 128)))
    attrs = dict(transpose=True, group_size=32, bits=4, mode="affine", sorted_indices=0) | quant
    g.instructions = [Instruction("gather_qmm", (x, w, s, b, None, idx), (out,), tuple(attrs.items()))]
    g.outputs = [out]
    return g


def test_a_possible_gather_qmm_validates():
    validate_graph(_gather_qmm())


@pytest.mark.parametrize(("quant", "says"), [
    (dict(bits=7), "takes bits"),
    (dict(group_size=48), "takes group sizes"),
    (dict(mode="int7"), "unknown quantization mode 'int7'"),
])  # fmt: skip
def test_a_gather_qmm_of_a_quantization_mlx_lacks_is_one_format_error(quant, says):
    with pytest.raises(FormatError, match=f"instruction \\d+ \\('gather_qmm'\\).*{says}"):
        validate_graph(_gather_qmm(**quant))
