"""ir.passes.simplify: each rewrite removes what it should, keeps what it must, and the
simplified graph computes bit-identical outputs (both graphs run by the interpreter on
the same random inputs; numpy is the oracle for the one rounding that must survive)."""
from __future__ import annotations

from collections import Counter

import numpy as np

import mlx_pte.runtime.mlx.blas  # noqa: F401
import mlx.core as mx

from mlx_pte.interpreter.program import Program
from mlx_pte.ir.graph import Graph, Instruction, ScalarType, SlotKind, SlotRef, SymDim, TensorType
from mlx_pte.ir.passes import simplify
from mlx_pte.ir.payload import check_graph

T = SymDim("T", 1, 8)


class G:
    """A tiny graph builder: ``g.op(op, inputs, out_dtype, out_shape, **attrs)`` returns the result slot."""

    def __init__(self) -> None:
        self.graph = Graph()

    def input(self, name: str, dtype: str, shape: tuple) -> int:
        slot = self.graph.add_slot(name, SlotKind.INPUT, TensorType(dtype, shape))
        self.graph.inputs.append(slot)
        return slot

    def op(self, op: str, inputs: tuple, out_dtype: str, out_shape: tuple, **attrs) -> int:
        out = self.graph.add_slot(f"t{len(self.graph.slots)}", SlotKind.TEMP, TensorType(out_dtype, out_shape))
        self.graph.instructions.append(Instruction(op, inputs, (out,), tuple(attrs.items())))
        return out


def _run(graph: Graph, inputs: list[np.ndarray]) -> list[np.ndarray]:
    outs = Program(graph, {}, {}).run(inputs)
    return [np.array(o.astype(mx.float32) if o.dtype == mx.bfloat16 else o) for o in outs]


def _simplified(g: G, outputs: list[int]) -> tuple[Graph, Graph]:
    g.graph.outputs = list(outputs)
    check_graph(g.graph)
    new, _ = simplify(g.graph, {})
    check_graph(new)
    return g.graph, new


def test_casts_views_permutes_and_duplicates_fold_exactly():
    rng = np.random.default_rng(0)
    g = G()
    x32 = g.input("x", "float32", (2, T, 4))
    xb = g.op("cast", (x32,), "bfloat16", (2, T, 4), dtype="bfloat16")
    round_trip = g.op("cast", (g.op("cast", (xb,), "float32", (2, T, 4), dtype="float32"),), "bfloat16", (2, T, 4),
                      dtype="bfloat16")  # fmt: skip  # bf16 -> f32 -> bf16: exact, folds to xb
    same = g.op("cast", (xb,), "bfloat16", (2, T, 4), dtype="bfloat16")  # folds to xb
    lossy = g.op("cast", (xb,), "float32", (2, T, 4), dtype="float32")  # f32 -> bf16 -> f32: must stay
    size = g.graph.add_slot("n", SlotKind.TEMP, ScalarType("int"))
    g.graph.instructions.append(Instruction("sym_size", (x32,), (size,), (("dim", 1),)))
    flat = g.op("view", (x32,), "float32", (2, T, 2, 2), shape=(2, SlotRef(size), 2, 2))
    back = g.op("view", (flat,), "float32", (2, T, 4), shape=(2, SlotRef(size), 4))  # folds to x32
    swapped = g.op("permute", (x32,), "float32", (T, 2, 4), dims=(1, 0, 2))
    unswapped = g.op("permute", (swapped,), "float32", (2, T, 4), dims=(1, 0, 2))  # folds to x32
    e1 = g.op("exp", (x32,), "float32", (2, T, 4))
    e2 = g.op("exp", (x32,), "float32", (2, T, 4))  # merges with e1
    g.op("neg", (x32,), "float32", (2, T, 4))  # dead
    before, after = _simplified(g, [round_trip, same, lossy, back, unswapped, e1, e2])
    ops = Counter(i.op for i in after.instructions)
    assert ops == {"cast": 2, "exp": 1}, ops  # x -> bf16, bf16 -> f32
    x = rng.standard_normal((2, 5, 4)).astype(np.float32)
    want = _run(before, [x])
    got = _run(after, [x])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    # The lossy round trip really rounds (it was right to keep it).
    assert not np.array_equal(got[2], x)
    np.testing.assert_array_equal(got[3], x)


def test_head_split_and_merge_pairs_fuse_only_with_one_reader():
    rng = np.random.default_rng(1)
    g = G()
    x = g.input("x", "float32", (1, 3, 8))
    split = g.op("view", (x,), "float32", (1, 3, 2, 4), shape=(1, 3, 2, 4))
    heads = g.op("permute", (split,), "float32", (1, 2, 3, 4), dims=(0, 2, 1, 3))
    merged = g.op("view", (g.op("permute", (heads,), "float32", (1, 3, 2, 4), dims=(0, 2, 1, 3)),), "float32",
                  (1, 3, 8), shape=(1, 3, 8))  # fmt: skip
    # A view read twice keeps its own instruction.
    shared = g.op("view", (x,), "float32", (3, 8), shape=(3, 8))
    t1 = g.op("permute", (shared,), "float32", (8, 3), dims=(1, 0))
    t2 = g.op("exp", (shared,), "float32", (3, 8))
    before, after = _simplified(g, [heads, merged, t1, t2])
    ops = Counter(i.op for i in after.instructions)
    # heads' permute pair cancels (merged = x); the head split fuses; the shared view stays.
    assert ops == {"view_permute": 1, "view": 1, "permute": 1, "exp": 1}, ops
    value = rng.standard_normal((1, 3, 8)).astype(np.float32)
    for a, b in zip(_run(after, [value]), _run(before, [value])):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(_run(after, [value])[0], value.reshape(1, 3, 2, 4).transpose(0, 2, 1, 3))


def test_the_cache_op_is_never_removed_or_merged():
    g = G()
    q = g.input("q", "float32", (1, 2, T, 4))
    pos = g.input("positions", "int64", (T,))
    attrs = dict(cache_id=0, scale=0.5, softcap=0.0)
    g.op("update_and_attend", (q, q, q, pos), "float32", (1, 2, T, 4), **attrs)  # result unread
    a = g.op("update_and_attend", (q, q, q, pos), "float32", (1, 2, T, 4), **attrs)
    _, after = _simplified(g, [a])
    assert [i.op for i in after.instructions] == ["update_and_attend"] * 2


def test_unused_slots_are_dropped_and_constants_renumbered():
    g = G()
    x = g.input("x", "float32", (4,))
    unused = g.graph.add_slot("unused_w", SlotKind.CONSTANT, TensorType("float32", (4,)))
    w = g.graph.add_slot("w", SlotKind.CONSTANT, TensorType("float32", (4,)))
    dead = g.op("mul", (x, unused), "float32", (4,))
    out = g.op("mul", (x, w), "float32", (4,))
    g.graph.outputs = [out]
    data = {unused: np.zeros(16, np.uint8), w: np.arange(16, dtype=np.uint8)}
    new, constants = simplify(g.graph, data)
    check_graph(new)
    assert dead not in new.outputs and len(new.instructions) == 1
    assert [s.name for s in new.slots] == ["x", "w", g.graph.slots[out].name]
    assert list(constants) == [1] and constants[1] is data[w]
