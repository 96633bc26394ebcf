"""Upstream's own MLX op test cases, built with upstream's partitioner and run on mlx-pte's
interpreter against eager torch (tests/upstream/op_suite.py).

The classes below cover every node type upstream's LLM exports emit; each of their cases
must pass. ``make test`` runs the first case of each; ``make test-slow`` runs them all and
the whole suite, whose per-class table it prints (cases of other classes may fail or be
unsupported: they are listed, not asserted)."""
from __future__ import annotations

import pytest

from .op_suite import FAILED, PASSED, UNSUPPORTED, cases, registry, run_case, run_suite, table

# Registered base names whose node types occur in upstream LLM exports (Addmm, RMSNorm,
# UpdateAndAttend, Take, AsType, Multiply, Add, Transpose, Slice, Concatenate, Reshape,
# ExpandDims, SymSize, Neg, Sin, Cos, Silu, Gelu).
LLM_CLASSES = (
    "add", "mul", "linear", "addmm", "aten_rms_norm", "embedding", "to_dtype", "permute", "slice",
    "cat", "unsqueeze", "neg", "sin", "cos", "silu", "gelu", "update_and_attend",
    # QuantizedMatmul, Take + Dequantize (4w / 8w / nvfp4 exports)
    "quantized_linear", "quantized_embedding", "int4_quantized_linear", "int4_quantized_embedding",
    "nvfp4_quantized_linear", "mxfp8_quantized_linear",
)  # fmt: skip
# One class per catalog op that only imported programs use (ir.catalog.UPSTREAM_ONLY), and
# the reductions over every axis: their first cases run in `make test`.
UPSTREAM_OP_CLASSES = (
    "floor", "ceil", "trunc", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh",
    "log2", "log10", "log1p", "expm1", "sign", "bitwise_not_int", "atan2", "logaddexp", "floor_divide",
    "remainder", "bitwise_and_int", "bitwise_or_int", "bitwise_xor_int", "prod", "logsumexp", "any", "all",
    "var", "std", "round", "tril", "triu", "cumsum", "roll", "full_like", "sort", "argsort", "topk", "flip",
    "repeat_interleave", "pad", "sdpa", "scatter_add", "max_global", "gather_mm", "gather_qmm",
)  # fmt: skip
# Upstream's MoE matmuls (GatherMm, GatherQmm; ItemInt reads the sorted flag): every case must
# pass; `make test` runs these ones too (the flag read at run time, a half type on MLX's CPU).
MOE_CLASSES = ("switch_linear", "quantized_switch_linear", "gather_mm", "gather_qmm")
MOE_CASES = ("gather_mm_e4_i64_o128_bfloat16_sorted", "gather_qmm_e4_i64_o128_g32_sorted")


def _params(first_only: bool, classes: tuple[str, ...] = LLM_CLASSES) -> list:
    tests = registry()
    params = []
    for base in classes:
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


@pytest.mark.parametrize(("base", "case"), _params(first_only=True, classes=UPSTREAM_OP_CLASSES))
def test_upstream_only_ops_first_case(base, case, tmp_path):
    _check(base, case, tmp_path)


@pytest.mark.parametrize(
    ("base", "case"), [p for p in _params(first_only=False, classes=MOE_CLASSES) if p.id in MOE_CASES]
)
def test_moe_matmuls_sorted_cases(base, case, tmp_path):
    _check(base, case, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(("base", "case"), _params(first_only=False))
def test_llm_node_types_every_case(base, case, tmp_path):
    _check(base, case, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(("base", "case"), _params(first_only=False, classes=MOE_CLASSES))
def test_moe_matmuls_every_case(base, case, tmp_path):
    _check(base, case, tmp_path)


# Upstream's exporter lowers every case of the suite (most of the time): on 2 busy cores it
# ran past the suite's default 600 s (a clean-clone `make test-slow`, tier 36 min that day).
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_whole_suite_table(capsys):
    results = run_suite()
    with capsys.disabled():
        print("\n" + table(results))
    assert all(r.outcome == PASSED for r in results if r.test_class in LLM_CLASSES + MOE_CLASSES)
    # Outside them a case may be unsupported (named below), but none computes wrong values.
    assert [f"{r.test_class}/{r.case}: {r.detail}" for r in results if r.outcome == FAILED] == []
    # Unsupported cases name the node types that are missing.
    assert all(r.node_types for r in results if r.outcome == UNSUPPORTED)
