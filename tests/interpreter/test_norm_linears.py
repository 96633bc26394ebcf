"""A norm and the linear reading it as one op (``ir.norm_linears``, applied at load).

The oracle is the same file loaded without the rewrite: where the CUDA kernel does not
run (here: the CPU), the fused ops run the ops they replace, so logits at every position
of a prefill and of decode steps must be equal bit for bit, captured or not, in every
family (Gemma's norms carry a cast or sit behind other ops, MoE layers route after the
norm: those stay as they were). Also: the rewrite happens where it should (both norms of
every Llama layer, the residual add joining the norm behind it) and only there.
"""
from __future__ import annotations

import numpy as np
import pytest

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)

from mlx_pte.interpreter import program as program_module
from mlx_pte.interpreter.program import load
from mlx_pte.ir.catalog import validate_graph
from mlx_pte.ir.norm_linears import fuse_norm_linears
from tests.fixtures.exported import exported_pte
from tests.interpreter.session_logits import logits_of

FUSED = ("rms_norm_linear", "add_rms_norm_linear")


def ops(graph) -> list[str]:
    return [instr.op for instr in graph.instructions]


def test_both_norms_of_every_llama_layer_join_their_projection(tmp_path_factory, tiny_checkpoint):
    program = load(exported_pte(tmp_path_factory, tiny_checkpoint, "llama"))
    on_file, loaded = ops(program.graph), ops(program.run_graph)
    layers = on_file.count("update_and_attend")
    # The first layer's input norm reads the embedding; every other norm a residual add.
    assert loaded.count("rms_norm_linear") == 1
    assert loaded.count("add_rms_norm_linear") == 2 * layers - 1
    fused = loaded.count("rms_norm_linear") + loaded.count("add_rms_norm_linear")
    assert loaded.count("rms_norm") == on_file.count("rms_norm") - fused
    assert loaded.count("linear") == on_file.count("linear") - fused
    assert loaded.count("add") == on_file.count("add") - loaded.count("add_rms_norm_linear")
    validate_graph(program.run_graph)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "mixtral"])
@pytest.mark.parametrize("capture", [False, True])
def test_logits_equal_the_unrewritten_programs_exactly(tmp_path_factory, tiny_checkpoint, monkeypatch, family,
                                                        capture):
    path = exported_pte(tmp_path_factory, tiny_checkpoint, family)
    rewritten = load(path)
    monkeypatch.setattr(program_module, "fuse_norm_linears", lambda graph: graph)
    plain = load(path)
    assert not set(FUSED) & set(ops(plain.run_graph))
    np.testing.assert_array_equal(logits_of(rewritten, capture), logits_of(plain, capture))


def test_a_norm_read_twice_stays_apart(tmp_path_factory, tiny_checkpoint):
    graph = load(exported_pte(tmp_path_factory, tiny_checkpoint, "llama")).graph
    norm = next(instr for instr in graph.instructions if instr.op == "rms_norm")
    # A second reader of the normalized row: the linear can no longer own it.
    graph = graph.__class__(**{**graph.__dict__, "outputs": (*graph.outputs, norm.outputs[0])})
    rewritten = fuse_norm_linears(graph)
    assert norm in rewritten.instructions
    validate_graph(rewritten)
