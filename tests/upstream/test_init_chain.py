"""The init chain folded at import (ir/upstream/init_chain.py) computes exactly what MLX's
multiply computes at load in upstream's runtime; what it cannot fold is one FormatError."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mlx_pte.interpreter.handlers import MX_DTYPES
from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.graph import Graph, SlotKind, TensorType
from mlx_pte.ir.upstream.builder import ImportBuilder
from mlx_pte.ir.upstream.init_chain import fold_init_chain

FLOATS = ("float32", "float16", "bfloat16")


def _tid(index: int) -> SimpleNamespace:
    return SimpleNamespace(idx=index)


def _multiply(a: int, b: int, out: int) -> tuple[str, SimpleNamespace]:
    return "MultiplyNode", SimpleNamespace(a=_tid(a), b=_tid(b), out=_tid(out))


def _setup(arrays: list[mx.array]) -> tuple[ImportBuilder, dict]:
    """Constants 0.. hold ``arrays``; tensors up to 8 exist."""
    graph = Graph()
    builder = ImportBuilder(graph, n_tensors=8, n_values=0, n_caches=None, writable_from=len(arrays))
    weights = {}
    for tid, array in enumerate(arrays):
        dtype = next(name for name, d in MX_DTYPES.items() if d == array.dtype)
        slot = graph.add_slot(f"c{tid}", SlotKind.CONSTANT, TensorType(dtype, tuple(array.shape)))
        weights[slot] = memoryview(np.array(array.view(mx.uint16) if dtype == "bfloat16" else array))
        builder.bind(tid, slot)
    return builder, weights


_STORED = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}  # bfloat16: its bits


def _value(builder: ImportBuilder, weights: dict, tid: int) -> mx.array:
    slot = builder.slot_of(tid)
    t = builder.graph.slots[slot].type
    array = mx.array(np.frombuffer(weights[slot], dtype=_STORED[t.dtype]).reshape(t.shape))
    return array.view(mx.bfloat16) if t.dtype == "bfloat16" else array


_values = st.floats(allow_nan=True, allow_infinity=True, width=32)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(FLOATS),
    scales=st.lists(_values, min_size=1, max_size=12),
    factor=_values,
)
def test_a_folded_product_is_mlxs_product(dtype, scales, factor):
    a = mx.array(np.array(scales, dtype=np.float32)).astype(MX_DTYPES[dtype]).reshape(1, -1)
    b = mx.array(np.float32(factor)).astype(MX_DTYPES[dtype])
    builder, weights = _setup([a, b, mx.zeros((), dtype=MX_DTYPES[dtype])])
    fold_init_chain(builder, [_multiply(0, 1, 2)], weights, inputs=range(3, 3))
    got, want = _value(builder, weights, 2), a * b
    assert builder.graph.slots[builder.slot_of(2)].kind is SlotKind.CONSTANT
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), equal_nan=True)


def test_the_quantized_biases_pattern_overwrites_the_placeholder():
    scales = mx.array([[0.5, 0.25], [2.0, 3.0]]).astype(mx.bfloat16)
    builder, weights = _setup([scales, mx.array(-8.0).astype(mx.bfloat16), mx.array(0.0).astype(mx.bfloat16)])
    placeholder = builder.slot_of(2)
    fold_init_chain(builder, [_multiply(0, 1, 2)], weights, inputs=range(3, 3))
    assert builder.slot_of(2) != placeholder
    assert np.array_equal(np.array(_value(builder, weights, 2).astype(mx.float32)), [[-4, -2], [-16, -24]])


@pytest.mark.parametrize(
    ("arrays", "instruction", "message"),
    [
        ([mx.ones((2,)), mx.ones((2,), dtype=mx.float16)], _multiply(0, 1, 2), "float16 by float32"),
        ([mx.ones((2,)), mx.ones((3,))], _multiply(0, 1, 2), "cannot be computed"),
        ([mx.ones((2,)), mx.ones((2,))], _multiply(0, 1, 8), "out of range"),
        ([mx.ones((2,)), mx.ones((2,))], _multiply(0, 5, 2), "before anything writes it"),
        ([mx.ones((2,)), mx.ones((2,))], ("AddNode", None), "folds only MultiplyNode"),
    ],
)
def test_what_cannot_be_folded_is_one_format_error(arrays, instruction, message):
    builder, weights = _setup(arrays)
    with pytest.raises(FormatError, match=message):
        fold_init_chain(builder, [instruction], weights, inputs=range(2, 3))


def test_the_init_chain_may_not_write_an_input():
    builder, weights = _setup([mx.ones((2,)), mx.ones((2,))])
    with pytest.raises(FormatError, match="an input"):
        fold_init_chain(builder, [_multiply(0, 1, 2)], weights, inputs=range(2, 3))
