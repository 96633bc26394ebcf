"""ir.fuse_projections: linears sharing an input become one matmul and a split that gives
the same values. Oracles: MLX's own ``mx.quantize`` / ``mx.dequantize`` (the packing) and
numpy matmuls of the unfused weights."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import mlx_pte.runtime.mlx.blas  # noqa: F401
import mlx.core as mx

from mlx_pte.interpreter.program import Program, load_weight
from mlx_pte.ir.fuse_projections import ALIGN, fuse_projections, fused_name, linear_count
from mlx_pte.ir.graph import Graph, Instruction, SlotKind, SymDim, TensorType
from mlx_pte.ir.passes import simplify
from mlx_pte.ir.payload import check_graph

T = SymDim("T", 1, 8)
K = 64
# (mode, bits, group size): every format MLX packs.
QUANT_TYPES = [("affine", 4, 32), ("affine", 8, 64), ("affine", 3, 64), ("mxfp4", 4, 32), ("mxfp8", 8, 32),
               ("nvfp4", 4, 16)]  # fmt: skip
# 9 heads of 8 and 3 of 8 (SmolLM2's 9/3 head pattern): offsets 72 and 96 are not aligned.
ROWS = (72, 24, 24)


def _bytes(a: mx.array) -> np.ndarray:
    a = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    return np.array(a).reshape(-1).view(np.uint8)


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


@pytest.mark.parametrize("mode,bits,group", QUANT_TYPES)
def test_packed_parts_of_stacked_rows_are_the_parts_stacked(mode, bits, group):
    """What fusing a quantized weight relies on: MLX packs rows independently."""
    rng = np.random.default_rng(0)
    blocks = [mx.array(rng.standard_normal((n, K)).astype(np.float32)) for n in ROWS]
    whole = mx.quantize(mx.concatenate(blocks), group_size=group, bits=bits, mode=mode)
    parts = [mx.quantize(b, group_size=group, bits=bits, mode=mode) for b in blocks]
    for i, packed in enumerate(whole):
        np.testing.assert_array_equal(np.array(packed), np.concatenate([np.array(p[i]) for p in parts]))
    # Padding rows are all-zero parts: they dequantize to zeros.
    zeros = [mx.zeros_like(p[:4]) for p in whole]
    deq = mx.dequantize(*zeros, group_size=group, bits=bits, mode=mode) if len(zeros) == 3 else \
        mx.dequantize(zeros[0], zeros[1], group_size=group, bits=bits, mode=mode)  # fmt: skip
    assert not np.any(_np(deq))


class _Graph:
    """x [T, K] read by one linear per weight; every result is a graph output."""

    def __init__(self, dtype: str) -> None:
        self.graph, self.constants, self.dtype = Graph(), {}, dtype
        self.x = self.graph.add_slot("x", SlotKind.INPUT, TensorType(dtype, (T, K)))
        self.graph.inputs.append(self.x)

    def constant(self, name: str, array: mx.array) -> int:
        dtype = str(array.dtype).removeprefix("mlx.core.")
        slot = self.graph.add_slot(name, SlotKind.CONSTANT, TensorType(dtype, tuple(array.shape)))
        self.constants[slot] = _bytes(array)
        return slot

    def linear(self, op: str, operands: tuple, rows: int, attrs: tuple = ()) -> None:
        out = self.graph.add_slot(f"y{len(self.graph.outputs)}", SlotKind.TEMP, TensorType(self.dtype, (T, rows)))
        self.graph.instructions.append(Instruction(op, (self.x, *operands), (out,), attrs))
        self.graph.outputs.append(out)


def _program(graph: Graph, constants: dict) -> Program:
    check_graph(graph)
    weights = {s: load_weight(np.asarray(constants[s]), graph.slots[s].type) for s in graph.constants()}
    return Program(graph, weights, {})


def _run(graph: Graph, constants: dict, x: mx.array, capture: bool) -> list[np.ndarray]:
    return [_np(o) for o in _program(graph, constants).run([x], capture=capture)]


def _split_offsets(graph: Graph) -> list[int]:
    """Where each piece of the one split that the graph reads starts."""
    (split,) = [i for i in graph.instructions if i.op == "split"]
    sizes = split.attr("sizes")
    return [sum(sizes[:i]) for i, out in enumerate(split.outputs) if out in graph.outputs]


@pytest.mark.parametrize("capture", [False, True], ids=["walked", "captured"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_linears_with_bias_give_each_projection(dtype, capture):
    rng = np.random.default_rng(1)
    mx_dtype = getattr(mx, dtype)
    g = _Graph(dtype)
    ws = [mx.array(rng.standard_normal((n, K)).astype(np.float32)).astype(mx_dtype) for n in ROWS]
    bs = [mx.array(rng.standard_normal((n,)).astype(np.float32)).astype(mx_dtype) for n in ROWS]
    for i, (w, b, n) in enumerate(zip(ws, bs, ROWS)):
        g.linear("linear", (g.constant(f"attn.{'qkv'[i]}_proj.weight", w), g.constant(f"attn.{'qkv'[i]}_proj.bias", b)), n)
    fused, constants = simplify(*fuse_projections(g.graph, g.constants))
    assert linear_count(g.graph.instructions) == 3 and linear_count(fused.instructions) == 1
    assert all(offset % ALIGN == 0 for offset in _split_offsets(fused))
    names = {fused.slots[s].name for s in fused.constants()}
    assert names == {"attn.qkv_proj.weight", "attn.qkv_proj.bias"}
    x = mx.array(rng.standard_normal((5, K)).astype(np.float32)).astype(mx_dtype)
    got = _run(fused, constants, x, capture)
    for y, w, b in zip(got, ws, bs):
        expected = _np(x) @ _np(w).T + _np(b)
        np.testing.assert_allclose(y, expected, rtol=0, atol=1e-4 if dtype == "float32" else 0.25)
    # Separate projections and fused ones agree to the dtype's rounding of each output.
    separate = _run(g.graph, g.constants, x, capture)
    for a, b in zip(got, separate):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 if dtype == "float32" else 0.07)


@pytest.mark.parametrize("mode,bits,group", QUANT_TYPES)
def test_fused_quantized_linears_match_dequantized_weights(mode, bits, group):
    rng = np.random.default_rng(2)
    g = _Graph("float32")
    attrs = (("group_size", group), ("bits", bits), ("mode", mode))
    dequantized = []
    for i, n in enumerate((96, 32)):  # gate and up of different widths
        parts = mx.quantize(mx.array(rng.standard_normal((n, K)).astype(np.float32)), group_size=group, bits=bits, mode=mode)
        dequantized.append(_np(mx.dequantize(*parts, group_size=group, bits=bits, mode=mode)))
        name = f"mlp.{('gate', 'up')[i]}_proj.weight"
        slots = [g.constant(name + suffix, p) for suffix, p in zip(("", ".scales", ".biases"), parts)]
        g.linear("quantized_linear", (*slots, *([None] * (3 - len(slots)))), n, attrs)
    fused, constants = simplify(*fuse_projections(g.graph, g.constants))
    assert linear_count(fused.instructions) == 1
    assert _split_offsets(fused) == [0, 128]  # gate's 96 rows, 32 of padding, then up
    assert {fused.slots[s].name.split(".")[1] for s in fused.constants()} == {"gate_up_proj"}
    x = mx.array(rng.standard_normal((3, K)).astype(np.float32))
    for y, w in zip(_run(fused, constants, x, capture=False), dequantized):
        np.testing.assert_allclose(y, _np(x) @ w.T, rtol=1e-5, atol=1e-4)


def test_only_linears_sharing_input_weight_kind_and_bias_fuse():
    rng = np.random.default_rng(3)
    g = _Graph("float32")
    w = lambda n, dtype=mx.float32: mx.array(rng.standard_normal((n, K)).astype(np.float32)).astype(dtype)  # noqa: E731
    g.linear("linear", (g.constant("a.weight", w(8)),), 8)
    g.linear("linear", (g.constant("b.weight", w(8)), g.constant("b.bias", mx.zeros((8,)))), 8)  # bias
    g.linear("linear", (g.constant("c.weight", w(8, mx.float16)),), 8)  # another dtype
    other = g.graph.add_slot("other", SlotKind.INPUT, TensorType("float32", (T, K)))
    g.graph.inputs.append(other)
    out = g.graph.add_slot("z", SlotKind.TEMP, TensorType("float32", (T, 8)))
    g.graph.instructions.append(Instruction("linear", (other, g.constant("d.weight", w(8))), (out,)))  # input
    fused, _ = fuse_projections(g.graph, g.constants)
    assert Counter(i.op for i in fused.instructions) == Counter({"linear": 4})


@pytest.mark.parametrize(
    "names,expected",
    [
        (["m.layers.0.self_attn.q_proj.weight", "m.layers.0.self_attn.k_proj.weight", "m.layers.0.self_attn.v_proj.weight"],
         "m.layers.0.self_attn.qkv_proj.weight"),
        (["m.layers.3.mlp.gate_proj.weight.scales", "m.layers.3.mlp.up_proj.weight.scales"],
         "m.layers.3.mlp.gate_up_proj.weight.scales"),
        (["w1", "w3"], "w1+w3"),
        (["mlp.fc_1.weight", "mlp.fc_2.weight"], "mlp.fc_1+fc_2.weight"),
        (["a.weight", "b.bias"], "a.weight+b.bias"),
    ],
)  # fmt: skip
def test_fused_name(names, expected):
    assert fused_name(names) == expected
