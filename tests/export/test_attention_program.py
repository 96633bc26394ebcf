"""A model with ``update_and_attend`` layers (``attention_model.TinyAttentionModel``)
exported to a .pte and run by the interpreter over each MLX cache kind, step by step,
against the eager exported program run over the reference cache of the same kind.
"""
from __future__ import annotations

import pytest
import torch

from mlx_pte.export.program import export_program
from mlx_pte.interpreter.program import load
from mlx_pte.runtime.cache import KINDS

from .attention_model import TinyAttentionModel, assert_program_matches_eager, export_tiny_attention


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(eager exported module, loaded program) of one TinyAttentionModel."""
    torch.manual_seed(0)
    ep = export_tiny_attention(TinyAttentionModel())
    path = export_program(ep, tmp_path_factory.mktemp("attention") / "tiny.pte")
    return ep.module(), load(path)


@pytest.mark.parametrize("kind", KINDS)
def test_program_over_mlx_cache_matches_eager_over_reference(exported, kind):
    eager, program = exported
    assert_program_matches_eager(program, eager, kind)


def test_attention_graph_calls_the_cache_once_per_layer(exported):
    _, program = exported
    calls = [i for i in program.graph.instructions if i.op == "update_and_attend"]
    assert [dict(i.attrs)["cache_id"] for i in calls] == [0, 1, 2]
    assert [dict(i.attrs)["softcap"] for i in calls] == [0.0, 0.0, 1.0]
