"""Attribute rules of the op catalog: each impossible value is one FormatError naming the
instruction (index and op) and the attribute; the possible neighbour of each passes."""
from __future__ import annotations

import pytest

from mlx_pte.ir.catalog import CATALOG, RULES, validate_graph
from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.graph import Graph, Instruction, ScalarType, SlotKind, SymDim, TensorType

T = SymDim("T", 1, 16)


def graph_with(op: str, attrs: dict, result_shape: tuple = (2, 3, 4), n_inputs: int = 1,
               scalar_result: bool = False) -> Graph:
    """x: float32[2, 3, 4] (n_inputs of them) -> op -> one result; a harmless 'neg' first, so
    the instruction under test has index 1."""
    g = Graph()
    xs = [g.add_slot(f"x{i}", SlotKind.INPUT, TensorType("float32", (2, 3, 4))) for i in range(n_inputs)]
    g.inputs = list(xs)
    first = g.add_slot("n", SlotKind.TEMP, TensorType("float32", (2, 3, 4)))
    kind = ScalarType("int") if scalar_result else TensorType("float32", result_shape)
    out = g.add_slot("out", SlotKind.TEMP, kind)
    operands = tuple(xs) if CATALOG[op].operands else ()
    g.instructions = [Instruction("neg", (xs[0],), (first,)), Instruction(op, operands, (out,), tuple(attrs.items()))]
    g.outputs = [out]
    return g


CASES = [
    # op, attribute, impossible value, possible value, expected words, graph options
    ("unsqueeze", "dim", 4, 3, "axis 4 is outside \\[0, 4\\)", dict(result_shape=(2, 3, 4, 1))),
    ("softmax", "dim", 3, 2, "axis 3 is outside", {}),
    ("sum", "dims", (2, 0), (0, 2), "distinct axes in increasing order", dict(result_shape=(3,))),
    ("sum", "dims", (0, 5), (0, 1), "axis 5 is outside", dict(result_shape=(4,))),
    ("squeeze", "dims", (7,), (1,), "axis 7 is outside", {}),
    ("permute", "dims", (0, 1, 1), (2, 0, 1), "not a permutation of the 3 axes", dict(result_shape=(4, 2, 3))),
    ("permute", "dims", (0, 1), (0, 2, 1), "not a permutation", dict(result_shape=(2, 4, 3))),
    ("cast", "dtype", "float99", "bfloat16", "must be one of float32", {}),
    ("gelu", "approximate", "fast", "tanh", "must be one of none, tanh", {}),
    ("view", "shape", (-1, -1), (6, -1), "more than one -1", dict(result_shape=(6, 4))),
    ("view", "shape", (-2, 12), (2, 12), "size -2 is below -1", dict(result_shape=(2, 12))),
    ("view", "shape", (24,), (2, 12), "has 1 entries, the result has rank 2", dict(result_shape=(2, 12))),
    ("expand", "shape", (5, -1, 3, 4), (5, -1, 3, 4), None, dict(result_shape=(5, 2, 3, 4))),
    ("expand", "shape", (5, -1, 9, 4), (5, 2, 3, 4), "size 9 differs from the result's 3", dict(result_shape=(5, 2, 3, 4))),
    ("tile", "reps", (1, -2, 1), (1, 2, 1), "count -2 is negative", dict(result_shape=(2, 6, 4))),
    ("split", "sizes", (1, -1), (1, 1), "size -1 is negative", {}),
    ("full", "shape", (2, 3, 5), (2, 3, 4), "size 5 differs", {}),
    ("full", "shape", (2, 3, 17), (2, 3, 16), "outside the result's range for T", dict(result_shape=(2, 3, T))),
    ("slice", "step", 0, 1, "must not be 0", {}),
    ("arange", "step", 0, 2, "must not be 0", dict(result_shape=(4,))),
    ("cat", "dim", 3, 2, "axis 3 is outside", dict(n_inputs=2, result_shape=(2, 3, 8))),
    ("scalar_floordiv", "b", 0, 3, "must not be 0", dict(scalar_result=True)),
    ("sym_size", "dim", 3, 2, "axis 3 is outside", dict(scalar_result=True)),
]
BASE_ATTRS = {
    "unsqueeze": {}, "softmax": {}, "sum": {"keepdim": False}, "squeeze": {}, "permute": {}, "cast": {},
    "gelu": {}, "view": {}, "expand": {}, "tile": {}, "split": {"dim": 1}, "full": {"value": 0.0, "dtype": "float32"},
    "slice": {"dim": 1, "start": 0, "end": 2}, "arange": {"start": 0, "end": 8, "dtype": "int64"}, "cat": {},
    "scalar_floordiv": {"a": 7}, "sym_size": {},
}  # fmt: skip


@pytest.mark.parametrize("op, name, bad, good, says, options", CASES)
def test_rule(op, name, bad, good, says, options):
    validate_graph(graph_with(op, {**BASE_ATTRS[op], name: good}, **options))
    if says is None:
        return
    with pytest.raises(FormatError, match=rf"^instruction 1 \('{op}'\): attribute '{name}'.*{says}"):
        validate_graph(graph_with(op, {**BASE_ATTRS[op], name: bad}, **options))


def test_every_rule_is_used_by_some_op():
    used = {a.rule for spec in CATALOG.values() for a in spec.attrs}
    assert set(RULES) <= used
