"""Queries and keys rotated by one ``rope`` (``ir.rotary_pairs``, applied at load).

The oracle is the same file loaded without the rewrite: its logits, at every position of
a prefill and of decode steps, must be equal bit for bit (RoPE rotates each head on its
own, so grouping heads changes no arithmetic). Also: the rewrite happens where it should
(one ``rope`` per layer for a fused-projection Llama, across the padding between q and k,
and on a shard's untyped values) and only there (Qwen3 normalises q and k per head before
rotating: two ropes stay).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)

from mlx_pte.interpreter import program as program_module
from mlx_pte.interpreter.program import load
from mlx_pte.ir.catalog import validate_graph
from mlx_pte.ir.graph import UNTYPED_TENSOR, SlotKind, TensorType
from mlx_pte.ir.pte import read_pte
from mlx_pte.ir.rotary_pairs import rotate_heads_together
from tests.fixtures.exported import exported_pte
from tests.interpreter.session_logits import logits_of



def ops(graph) -> list[str]:
    return [instr.op for instr in graph.instructions]


@pytest.fixture(scope="module")
def llama_pte(tmp_path_factory, tiny_checkpoint):
    return exported_pte(tmp_path_factory, tiny_checkpoint, "llama")


def test_a_fused_projection_llama_rotates_once_per_layer(llama_pte):
    program = load(llama_pte)
    on_file, loaded = program.graph, program.run_graph
    layers = ops(on_file).count("update_and_attend")
    assert ops(on_file).count("rope") == 2 * layers
    assert ops(loaded).count("rope") == layers
    assert ops(loaded).count("split") == ops(on_file).count("split") + layers


@pytest.mark.parametrize("capture", [False, True])
def test_logits_equal_the_unrewritten_programs_exactly(llama_pte, monkeypatch, capture):
    rewritten = logits_of(load(llama_pte), capture)
    monkeypatch.setattr(program_module, "rotate_heads_together", lambda graph: graph)
    plain = load(llama_pte)
    assert ops(plain.run_graph).count("rope") == 2 * ops(plain.run_graph).count("update_and_attend")
    np.testing.assert_array_equal(rewritten, logits_of(plain, capture))


def test_per_head_norms_before_rotation_keep_two_ropes(tmp_path_factory, tiny_checkpoint):
    path = exported_pte(tmp_path_factory, tiny_checkpoint, "qwen3")
    program = load(path)
    assert ops(program.run_graph).count("rope") == ops(program.graph).count("rope") == 2 * ops(
        program.graph).count("update_and_attend")


def test_untyped_head_groups_as_a_shard_holds_them_rotate_once_too(llama_pte):
    graph = read_pte(llama_pte).graph
    # A tensor-parallel shard forgets the types of its rank-local values.
    untyped = replace(graph, slots=[replace(s, type=UNTYPED_TENSOR) if s.kind is SlotKind.TEMP
                                    and isinstance(s.type, TensorType) else s for s in graph.slots])
    rewritten = rotate_heads_together(untyped)
    assert ops(rewritten).count("rope") == ops(graph).count("update_and_attend")
    validate_graph(rewritten)
