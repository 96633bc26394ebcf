"""A norm and the linear reading it as one op (``ir.norm_linears``, applied at load).

The rewrite happens where it should (both norms of every Llama layer, the residual add
joining the norm behind it; Gemma's norms carry a cast or sit behind other ops, MoE layers
route after the norm: those stay as they were) and only there, and a q4 export's logits are
those of the unrewritten program, bit for bit (every family's, in ``test_load_rewrites.py``).
"""
from __future__ import annotations

import numpy as np
import pytest

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.interpreter.program import Program, load
from mlx_pte.ir.catalog import validate_graph
from mlx_pte.ir.graph import Graph, Instruction, SlotKind, SymDim, TensorType
from mlx_pte.ir.norm_linears import fuse_norm_linears
from mlx_pte.ir.quantization import QuantSpec
from tests.fixtures.exported import exported_pte
from tests.interpreter.session_logits import assert_rewrite_is_exact, op_names

FUSED = {"rms_norm_linear", "add_rms_norm_linear", "rms_norm_quantized_linear", "add_rms_norm_quantized_linear"}
Q4 = QuantSpec("affine", 4, 32)
T = SymDim("T", 1, 8)


def test_both_norms_of_every_llama_layer_join_their_projection(tmp_path_factory, tiny_checkpoint):
    program = load(exported_pte(tmp_path_factory, tiny_checkpoint, "llama"))
    on_file, loaded = op_names(program.graph), op_names(program.run_graph)
    layers = on_file.count("update_and_attend")
    # The first layer's input norm reads the embedding and the final norm the LM head's rows
    # (selected before it); every other norm reads a residual add.
    assert loaded.count("rms_norm_linear") == 2
    assert loaded.count("rms_norm") == 0
    assert loaded.count("add_rms_norm_linear") == 2 * layers - 1
    fused = loaded.count("rms_norm_linear") + loaded.count("add_rms_norm_linear")
    assert loaded.count("rms_norm") == on_file.count("rms_norm") - fused
    # The down projections join their GLU (test_glu_linears.py).
    assert loaded.count("linear") == on_file.count("linear") - fused - loaded.count("glu_linear")
    assert loaded.count("add") == on_file.count("add") - loaded.count("add_rms_norm_linear")
    validate_graph(program.run_graph)


@pytest.mark.parametrize("capture", [False, True])
def test_quantized_linears_join_their_norms_with_the_same_logits(tmp_path_factory, tiny_checkpoint, monkeypatch,
                                                                 capture):
    path = exported_pte(tmp_path_factory, tiny_checkpoint, "llama", Q4)
    rewritten = load(path)
    loaded, layers = op_names(rewritten.run_graph), op_names(rewritten.graph).count("update_and_attend")
    assert loaded.count("rms_norm_quantized_linear") == 2  # the first layer's input norm, the final norm
    assert loaded.count("add_rms_norm_quantized_linear") == 2 * layers - 1
    assert "rms_norm" not in loaded
    validate_graph(rewritten.run_graph)
    assert_rewrite_is_exact(path, monkeypatch, "fuse_norm_linears", FUSED, capture)


def test_a_norm_read_twice_stays_apart(tmp_path_factory, tiny_checkpoint):
    graph = load(exported_pte(tmp_path_factory, tiny_checkpoint, "llama")).graph
    norm = next(instr for instr in graph.instructions if instr.op == "rms_norm")
    # A second reader of the normalized row: the linear can no longer own it.
    graph = graph.__class__(**{**graph.__dict__, "outputs": (*graph.outputs, norm.outputs[0])})
    rewritten = fuse_norm_linears(graph)
    assert norm in rewritten.instructions
    validate_graph(rewritten)


def _norm_then(selections: list[tuple[str, tuple, dict]]) -> tuple[Graph, dict[int, np.ndarray]]:
    """x [2, T, 8] -> rms_norm -> each selection in turn -> a linear to 5 features; the
    norm's weight is the first constant, the linear's the second."""
    graph = Graph()

    def slot(kind: SlotKind, shape: tuple) -> int:
        return graph.add_slot(f"s{len(graph.slots)}", kind, TensorType("float32", shape))

    x, index = slot(SlotKind.INPUT, (2, T, 8)), graph.add_slot("index", SlotKind.INPUT, TensorType("int64", (1,)))
    graph.inputs.extend([x, index])
    norm_weight, value = slot(SlotKind.CONSTANT, (8,)), slot(SlotKind.TEMP, (2, T, 8))
    graph.instructions.append(Instruction("rms_norm", (x, norm_weight), (value,), (("eps", 1e-5),)))
    for op, shape, attrs in selections:
        result = slot(SlotKind.TEMP, shape)
        inputs = (value, index) if op == "index_select" else (value,)
        graph.instructions.append(Instruction(op, inputs, (result,), tuple(attrs.items())))
        value = result
    *rows, features = graph.slots[value].type.shape
    weight, out = slot(SlotKind.CONSTANT, (5, features)), slot(SlotKind.TEMP, (*rows, 5))
    graph.instructions.append(Instruction("linear", (value, weight, None), (out,)))
    graph.outputs.append(out)
    rng = np.random.default_rng(0)
    return graph, {norm_weight: rng.standard_normal(8).astype(np.float32),
                   weight: rng.standard_normal((5, features)).astype(np.float32)}


def test_row_selections_move_before_the_norm_which_joins_the_linear():
    # The final norm's shape: a batch row, then the positions the LM head reads.
    graph, weights = _norm_then([("select", (T, 8), {"dim": 0, "index": 1}), ("index_select", (1, 8), {"dim": 0})])
    rewritten = fuse_norm_linears(graph)
    validate_graph(rewritten)
    assert op_names(rewritten) == ["select", "index_select", "rms_norm_linear"]
    x = np.random.default_rng(1).standard_normal((2, 6, 8)).astype(np.float32)
    index = np.array([4], dtype=np.int64)
    (got,) = Program(rewritten, {k: mx.array(v) for k, v in weights.items()}, {}).run([x, index])
    norm_weight, weight = weights.values()
    rows = x[1, index].astype(np.float64)
    normed = rows / np.sqrt(np.mean(rows**2, axis=-1, keepdims=True) + 1e-5) * norm_weight
    np.testing.assert_allclose(np.array(got), normed @ weight.T, rtol=1e-5, atol=1e-5)


def test_a_selection_along_the_normalized_axis_stays_after_the_norm():
    graph, _ = _norm_then([("slice", (2, T, 4), {"dim": -1, "start": 0, "end": 4, "step": 1})])
    assert op_names(fuse_norm_linears(graph)) == ["rms_norm", "slice", "linear"]
