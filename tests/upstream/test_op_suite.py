"""Upstream's own MLX op test cases, built with upstream's partitioner and run on mlx-pte's
interpreter against eager torch (tests/upstream/op_suite.py).

The classes below cover every node type upstream's LLM exports emit; each of their cases
must pass. ``make test`` runs the first case of each; ``make test-slow`` runs them all and
the whole suite, whose per-class table it prints (cases of other classes may fail or be
unsupported: they are listed, not asserted)."""
from __future__ import annotations

import pytest

from .op_suite import PASSED, UNSUPPORTED, cases, registry, run_case, run_suite, table

# Registered base names whose node types occur in upstream LLM exports (Addmm, RMSNorm,
# UpdateAndAttend, Take, AsType, Multiply, Add, Transpose, Slice, Concatenate, Reshape,
# ExpandDims, SymSize, Neg, Sin, Cos, Silu, Gelu).
LLM_CLASSES = (
    "add", "mul", "linear", "addmm", "aten_rms_norm", "embedding", "to_dtype", "permute", "slice",
    "cat", "unsqueeze", "neg", "sin", "cos", "silu", "gelu", "update_and_attend",
)  # fmt: skip


def _params(first_only: bool) -> list:
    tests = registry()
    params = []
    for base in LLM_CLASSES:
        for i, case in enumerate(cases(tests[base])):
            if first_only and i:
                break
            params.append(pytest.param(base, case, id=getattr(case, "name", base)))
    return params


def _check(base, case, tmp_path):
    result = run_case(base, case, tmp_path)
    assert result.outcome == PASSED, f"{result.outcome}: {result.detail}"


@pytest.mark.parametrize(("base", "case"), _params(first_only=True))
def test_llm_node_types_first_case(base, case, tmp_path):
    _check(base, case, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(("base", "case"), _params(first_only=False))
def test_llm_node_types_every_case(base, case, tmp_path):
    _check(base, case, tmp_path)


@pytest.mark.slow
def test_whole_suite_table(capsys):
    results = run_suite()
    with capsys.disabled():
        print("\n" + table(results))
    assert all(r.outcome == PASSED for r in results if r.test_class in LLM_CLASSES)
    # Unsupported cases name the node types that are missing.
    assert all(r.node_types for r in results if r.outcome == UNSUPPORTED)
