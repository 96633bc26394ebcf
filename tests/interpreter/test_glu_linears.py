"""A GLU and the down projection reading it as one op (``ir.glu_linears``, applied at load).

The rewrite happens where it should (every dense MLP's glu, fused gate/up or not; MoE
experts hold their GLU inside the experts op) and only there, a glu-linear built by hand
matches numpy, and a q4 export's logits are those of the unrewritten program, bit for bit
(every family's, in ``test_load_rewrites.py``).
"""
from __future__ import annotations

import numpy as np
import pytest

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.interpreter.program import Program, load
from mlx_pte.ir.catalog import lookup, validate_graph
from mlx_pte.ir.errors import FormatError
from mlx_pte.ir.glu_linears import fuse_glu_linears
from mlx_pte.ir.graph import Graph, Instruction, SlotKind, SymDim, TensorType
from mlx_pte.ir.quantization import QuantSpec
from tests.fixtures.exported import exported_pte
from tests.interpreter.session_logits import assert_rewrite_is_exact, op_names

FUSED = {"glu_linear", "glu_quantized_linear"}
T = SymDim("T", 1, 8)


def test_every_llama_mlp_joins_its_down_projection(tmp_path_factory, tiny_checkpoint):
    program = load(exported_pte(tmp_path_factory, tiny_checkpoint, "llama"))
    on_file, loaded = op_names(program.graph), op_names(program.run_graph)
    layers = on_file.count("update_and_attend")
    assert on_file.count("glu") == layers
    assert loaded.count("glu_linear") == layers and "glu" not in loaded
    # The fused gate/up projection stays: the glu reads it whole, with the halves' width.
    assert all(instr.attr("width") for instr in program.run_graph.instructions if instr.op == "glu_linear")
    validate_graph(program.run_graph)


@pytest.mark.parametrize("capture", [False, True])
def test_quantized_down_projections_join_their_glu_with_the_same_logits(tmp_path_factory, tiny_checkpoint,
                                                                        monkeypatch, capture):
    path = exported_pte(tmp_path_factory, tiny_checkpoint, "llama", QuantSpec("affine", 4, 32))
    rewritten = load(path)
    loaded, layers = op_names(rewritten.run_graph), op_names(rewritten.graph).count("update_and_attend")
    assert loaded.count("glu_quantized_linear") == layers and "glu" not in loaded
    validate_graph(rewritten.run_graph)
    assert_rewrite_is_exact(path, monkeypatch, "fuse_glu_linears", FUSED, capture)


def _glu_then_linear(fused: bool, activation: str = "silu") -> tuple[Graph, dict[int, np.ndarray]]:
    """x [1, T, 6] -> a gate/up projection (one of 2 * 5 + 2 padding features, or two of 5)
    -> glu -> a linear to 3 features."""
    graph = Graph()

    def slot(kind: SlotKind, shape: tuple) -> int:
        return graph.add_slot(f"s{len(graph.slots)}", kind, TensorType("float32", shape))

    rng = np.random.default_rng(3)
    x = slot(SlotKind.INPUT, (1, T, 6))
    graph.inputs.append(x)
    weights: dict[int, np.ndarray] = {}
    projected = []
    for features in ([12] if fused else [5, 5]):
        weight, out = slot(SlotKind.CONSTANT, (features, 6)), slot(SlotKind.TEMP, (1, T, features))
        weights[weight] = rng.standard_normal((features, 6)).astype(np.float32)
        graph.instructions.append(Instruction("linear", (x, weight, None), (out,)))
        projected.append(out)
    glued = slot(SlotKind.TEMP, (1, T, 5))
    attrs = (("activation", activation), *((("width", 5),) if fused else ()))
    graph.instructions.append(Instruction("glu", (projected[0], projected[1] if not fused else None), (glued,), attrs))
    down, bias, out = slot(SlotKind.CONSTANT, (3, 5)), slot(SlotKind.CONSTANT, (3,)), slot(SlotKind.TEMP, (1, T, 3))
    weights[down], weights[bias] = rng.standard_normal((3, 5)).astype(np.float32), np.float32([0.5, -1, 2])
    graph.instructions.append(Instruction("linear", (glued, down, bias), (out,)))
    graph.outputs.append(out)
    return graph, weights


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_a_glu_linear_matches_numpy(fused, activation):
    graph, weights = _glu_then_linear(fused, activation)
    rewritten = fuse_glu_linears(graph)
    validate_graph(rewritten)
    assert op_names(rewritten) == ["linear"] * (1 if fused else 2) + ["glu_linear"]
    x = np.random.default_rng(4).standard_normal((1, 4, 6)).astype(np.float32)
    (got,) = Program(rewritten, {k: mx.array(v) for k, v in weights.items()}, {}).run([x])
    *projections, down, bias = (w.astype(np.float64) for w in weights.values())
    both = np.concatenate([x @ p.T for p in projections], axis=-1)
    gate, up = both[..., :5], both[..., -5:]
    if activation == "silu":
        act = gate / (1 + np.exp(-gate))
    else:
        act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
    np.testing.assert_allclose(np.array(got), (act * up) @ down.T + bias, rtol=1e-5, atol=1e-5)


def test_a_glu_read_twice_stays_apart():
    graph, _ = _glu_then_linear(fused=True)
    glu = next(instr for instr in graph.instructions if instr.op == "glu")
    # A second reader of the GLU's row: the linear can no longer own it.
    graph.outputs.append(glu.outputs[0])
    rewritten = fuse_glu_linears(graph)
    assert glu in rewritten.instructions and "glu_linear" not in op_names(rewritten)


def test_a_glu_linear_whose_width_does_not_fit_is_refused():
    graph, _ = _glu_then_linear(fused=True)
    fused = fuse_glu_linears(graph).instructions[-1]
    bad = Instruction(fused.op, fused.inputs, fused.outputs, (("activation", "silu"), ("width", 7)))
    with pytest.raises(FormatError, match="width 7 must be >= 1 and fit twice"):
        lookup(bad.op).validate(bad, graph)
