"""The catalog entries of the ops that only imported upstream ExecuTorch programs use
(``ir.upstream``): mlx-pte's exporter never emits them; upstream's own op test cases check
them against eager torch (tests/upstream/test_op_suite.py). Operands keep their dtypes:
MLX promotes, as upstream's runtime does.
"""
from __future__ import annotations

from .catalog import AttrSpec, OpSpec, _attrs, define
from .catalog_core import _REDUCTION_ATTRS

UPSTREAM_UNARY = (
    "floor", "ceil", "trunc", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh",
    "atanh", "log2", "log10", "log1p", "expm1", "sign", "bitwise_not",
)  # fmt: skip
UPSTREAM_BINARY = (
    "atan2", "logaddexp", "floor_divide", "remainder", "bitwise_and", "bitwise_or", "bitwise_xor",
)  # fmt: skip
UPSTREAM_REDUCTIONS = ("prod", "logsumexp", "any", "all")
for _name in UPSTREAM_UNARY:
    define(OpSpec(_name, ("x",), output_rule="like x (MLX's op of the same name)"))
for _name in UPSTREAM_BINARY:
    define(OpSpec(_name, ("a", "b"), output_rule="broadcast shape of a and b; MLX's type promotion"))
for _name in UPSTREAM_REDUCTIONS:
    define(OpSpec(_name, ("x",), _REDUCTION_ATTRS,
                  output_rule="x reduced over dims (kept as size 1 if keepdim); bool for any/all, else dtype of x"))
for _name in ("var", "std"):
    define(
        OpSpec(
            _name,
            ("x",),
            _REDUCTION_ATTRS + _attrs(("ddof", "int")),
            output_rule="x's variance (std: its square root) over dims, divided by count - ddof; dtype of x",
        )
    )
define(OpSpec("round", ("x",), _attrs(("decimals", "int")), output_rule="like x, rounded half to even"))
for _name in ("tril", "triu"):
    define(OpSpec(_name, ("x",), _attrs(("k", "int")),
                  output_rule="like x, zero above (tril) / below (triu) diagonal k of the last two axes"))
define(
    OpSpec(
        "cumsum",
        ("x",),
        _attrs(("dim", "int", True, "axis"), ("reverse", "bool"), ("inclusive", "bool")),
        output_rule="like x: running sums along dim",
    )
)
define(
    OpSpec(
        "roll",
        ("x",),
        _attrs(("shifts", "ints_or_refs"), ("dims", "ints")),
        output_rule="like x, rolled by shifts[i] along dims[i]",
    )
)
define(
    OpSpec(
        "full_like",
        ("x",),
        _attrs(("value", "float"), ("dtype", "dtype", False)),
        output_rule="x's shape filled with value; dtype, or x's when absent",
    )
)
for _name in ("sort", "argsort"):
    define(OpSpec(_name, ("x",), _attrs(("dim", "int", True, "axis")),
                  output_rule="x's shape: sorted along dim (argsort: the indices that sort, uint32)"))
for _name in ("partition", "argpartition"):
    define(
        OpSpec(
            _name,
            ("x",),
            _attrs(("kth", "int_or_ref"), ("dim", "int", True, "axis")),
            output_rule="x's shape, along dim: element kth in its sorted place, none larger before it, "
            "none smaller after (argpartition: their indices, uint32)",
        )
    )
define(OpSpec("flip", ("x",), _attrs(("dims", "ints")), output_rule="like x, reversed along dims"))
define(
    OpSpec(
        "repeat_interleave",
        ("x",),
        _attrs(("repeats", "int_or_ref"), ("dim", "int", True, "axis")),
        output_rule="x with each element repeated `repeats` times along dim",
    )
)
define(
    OpSpec(
        "pad",
        ("x",),
        (AttrSpec("widths", "ints_or_refs"), AttrSpec("mode", "str", choices=("constant", "edge")),
         AttrSpec("value", "float")),
        output_rule="x padded by (widths[2i], widths[2i + 1]) before and after axis i; constant value or "
        "the edge element",
    )  # fmt: skip
)
define(
    OpSpec(
        "sdpa",
        ("q", "k", "v", "mask?"),
        _attrs(("scale", "float"), ("causal", "bool")),
        output_rule="[B, Hq, T, Dv]: softmax(q @ k.T * scale + mask) @ v, k and v heads shared by groups of q "
        "heads; a bool mask selects, a float mask adds; causal masks the upper right (MLX's fast sdpa)",
    )
)
define(
    OpSpec(
        "scatter_add",
        ("x", "index", "updates"),
        _attrs(("dim", "int", True, "axis")),
        output_rule="like x, plus each updates[i...] at x[i...] with axis dim replaced by index[i...] "
        "(torch's scatter_add: index and updates of one shape, x's rank)",
    )
)
UPSTREAM_ONLY = frozenset(
    UPSTREAM_UNARY + UPSTREAM_BINARY + UPSTREAM_REDUCTIONS
    + ("var", "std", "round", "tril", "triu", "cumsum", "roll", "full_like", "sort", "argsort", "partition",
       "argpartition", "flip", "repeat_interleave", "pad", "sdpa", "scatter_add")
    + ("gather_mm", "gather_qmm", "item")  # ir.catalog_moe: upstream's MoE matmuls and their sorted flag
)  # fmt: skip
