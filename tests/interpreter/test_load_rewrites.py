"""The load-time rewrites that fuse ops for the GPU's kernels (``ir.norm_linears``,
``ir.glu_linears``), each against the same file loaded without it.

Where the CUDA kernels do not run (here: the CPU), a fused op runs the ops it replaces, so
the logits at every position of a prefill and of decode steps must be equal bit for bit,
captured or not, in every family.
"""
from __future__ import annotations

import pytest

from tests.fixtures.exported import exported_pte
from tests.interpreter.session_logits import assert_rewrite_is_exact

# A rewrite's name in interpreter.program -> the ops it makes.
REWRITES = {
    "fuse_norm_linears": {"rms_norm_linear", "add_rms_norm_linear", "rms_norm_quantized_linear",
                          "add_rms_norm_quantized_linear"},
    "fuse_glu_linears": {"glu_linear", "glu_quantized_linear"},
}


@pytest.mark.parametrize("rewrite", list(REWRITES))
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "mixtral"])
@pytest.mark.parametrize("capture", [False, True])
def test_logits_equal_the_unrewritten_programs_exactly(tmp_path_factory, tiny_checkpoint, monkeypatch, rewrite,
                                                        family, capture):
    path = exported_pte(tmp_path_factory, tiny_checkpoint, family)
    assert_rewrite_is_exact(path, monkeypatch, rewrite, REWRITES[rewrite], capture)
