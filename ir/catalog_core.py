"""Catalog entries of the core ops: elementwise, reductions, the fused norms, rotary and
gated-MLP ops, linear algebra and indexing, layout, creation, host integer arithmetic,
the runtime-owned KV cache's ``update_and_attend``, quantized weights and collectives.
Imported by ``ir.catalog``, whose ``define`` they use (its docstring states the
conventions every entry follows)."""
from __future__ import annotations

import math

from . import quantization
from .catalog import AttrSpec, OpSpec, _attrs, define
from .catalog_rules import is_int
from .errors import FormatError
from .graph import Graph, Instruction, TensorType

# Elementwise, numpy broadcasting; operands already share the result dtype.
ELEMENTWISE_UNARY = (
    "neg", "abs", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid",
    "relu", "silu", "erf", "reciprocal",
)  # fmt: skip
ELEMENTWISE_BINARY = ("add", "sub", "mul", "div", "pow", "maximum", "minimum")
COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")
LOGICAL_BINARY = ("logical_and", "logical_or")
REDUCTIONS = ("sum", "mean", "amax", "amin")

for _name in ELEMENTWISE_UNARY:
    define(OpSpec(_name, ("x",)))
define(OpSpec("gelu", ("x",), (AttrSpec("approximate", "str", choices=("none", "tanh")),),
              output_rule="like x; approximate 'none' (erf) or 'tanh'"))
define(OpSpec("clamp", ("x",), _attrs(("min", "float", False), ("max", "float", False))))
for _name in ELEMENTWISE_BINARY:
    define(OpSpec(_name, ("a", "b"), output_rule="broadcast shape of a and b, dtype of a"))
for _name in COMPARISONS:
    define(OpSpec(_name, ("a", "b"), output_rule="broadcast shape of a and b, bool"))
# Operands already bool (the lowering casts: nonzero is true, as in torch).
for _name in LOGICAL_BINARY:
    define(OpSpec(_name, ("a", "b"), output_rule="broadcast shape of a and b, bool"))
define(OpSpec("logical_not", ("x",), output_rule="like x (bool)"))
define(OpSpec("where", ("cond", "a", "b"), output_rule="broadcast shape of the three, dtype of a"))
define(OpSpec("cast", ("x",), _attrs(("dtype", "dtype")), output_rule="x's shape, the given dtype"))

# Reductions over ``dims`` (non-negative, sorted).
_REDUCTION_ATTRS = _attrs(("dims", "ints", True, "sorted_axes"), ("keepdim", "bool"))
for _name in REDUCTIONS:
    define(OpSpec(_name, ("x",), _REDUCTION_ATTRS,
                  output_rule="x reduced over dims (kept as size 1 if keepdim); dtype of x"))  # fmt: skip
define(
    OpSpec(
        "argmax",
        ("x",),
        _attrs(("dim", "int", False, "axis"), ("keepdim", "bool")),
        output_rule="index of the max along dim (over the flattened x when dim is absent); int64",
    )
)
define(OpSpec("softmax", ("x",), _attrs(("dim", "int", True, "axis")), output_rule="like x; accumulated in fp32"))
define(OpSpec("log_softmax", ("x",), _attrs(("dim", "int", True, "axis")), output_rule="like x; accumulated in fp32"))
define(
    OpSpec(
        "rms_norm",
        ("x", "weight?"),
        _attrs(("eps", "float"), ("dtype", "dtype", False)),
        output_rule="x's shape, normalized over the last dim: x * rsqrt(mean(x**2) + eps) computed in fp32, "
        "rounded to result_type(x, weight), times weight in that dtype, then cast to dtype when given",
    )
)
define(
    OpSpec(
        "layer_norm",
        ("x", "weight?", "bias?"),
        _attrs(("eps", "float")),
        output_rule="like x, normalized over the last dim",
    )
)
define(
    OpSpec(
        "rope_half",
        ("x", "cos", "sin"),
        output_rule="like x: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2]) "
        "along the last dim (HF's rotary embedding); cos and sin broadcast to x and share its dtype",
    )
)
def _check_table_scale(instr: Instruction, graph: Graph) -> None:
    scale = instr.attr("table_scale")
    if scale is not None and not math.isfinite(scale):
        raise FormatError(f"instruction 'rope': attribute 'table_scale' must be a finite number, got {scale!r}")


define(
    OpSpec(
        "rope",
        ("x", "positions", "inv_freq"),
        _attrs(("seq_axis", "int", True, "seq_axis"), ("table_scale", "float", False)),
        output_rule="like x, [1, H, T, D] (seq_axis 2) or [1, T, H, D] (seq_axis 1): rope_half(x, cos, sin) with "
        "angles positions[t] * inv_freq (int positions [T], fp32 inv_freq [D/2]) computed in fp32, duplicated "
        "over both halves, cos/sin times table_scale (default 1; HF's attention_scaling, e.g. YaRN's) in fp32, "
        "then rounded to x's dtype (HF's rotary embedding)",
        check=_check_table_scale,
    )
)
def _check_glu_halves(instr: Instruction, graph: Graph) -> None:
    """``width`` is given exactly when ``up`` is left out, and fits twice in gate's last axis."""
    fused = len(instr.inputs) < 2 or instr.inputs[1] is None
    width = instr.attr("width")
    if fused != (width is not None):
        raise FormatError(f"instruction {instr.op!r}: attribute 'width' belongs with a fused gate/up operand (up "
                          "left out), and only there")
    t = graph.slots[instr.inputs[0]].type  # type: ignore[index]
    total = t.shape[-1] if isinstance(t, TensorType) and t.shape else None
    if fused and (not is_int(width) or width < 1 or (is_int(total) and 2 * width > total)):
        raise FormatError(f"instruction {instr.op!r}: width {width} must be >= 1 and fit twice in the fused "
                          f"operand's last axis of {total}")


_GLU_ATTRS = _attrs(("activation", "str", True, None, ("silu", "gelu", "gelu_tanh")), ("width", "int", False))
define(
    OpSpec(
        "glu",
        ("gate", "up?"),
        _GLU_ATTRS,
        output_rule="like gate: act(gate) * up, act computed in fp32 and rounded to gate's dtype (as torch "
        "does); activation 'silu' (SwiGLU), 'gelu' or 'gelu_tanh' (GeGLU). With up left out, gate is a fused "
        "gate/up projection: its first `width` columns are the gate, its last `width` the up (padding between)",
        check=_check_glu_halves,
    )
)

# Linear algebra and indexing.
define(OpSpec("matmul", ("a", "b"), output_rule="numpy matmul of a and b (batch dims broadcast); dtype of a"))
define(
    OpSpec(
        "linear",
        ("x", "weight", "bias?"),
        output_rule="x @ weight.T (+ bias): x's shape with the last dim = weight.shape[0]; dtype of x",
    )
)
define(OpSpec("embedding", ("weight", "indices"), output_rule="indices.shape + weight.shape[1:]; dtype of weight"))
define(
    OpSpec(
        "index_select",
        ("x", "index"),
        _attrs(("dim", "int", True, "axis")),
        output_rule="x with dim replaced by len(index) (index 1-D, int)",
    )
)
define(
    OpSpec(
        "gather",
        ("x", "index"),
        _attrs(("dim", "int", True, "axis")),
        output_rule="index's shape: x[..., index[...], ...] along dim (take-along-axis)",
    )
)

# Layout. Shapes may hold SlotRefs; view takes one -1, expand takes -1 for "keep".
define(OpSpec("view", ("x",), _attrs(("shape", "ints_or_refs", True, "view_shape")),
              output_rule="x's elements in the given shape"))
define(OpSpec("permute", ("x",), _attrs(("dims", "ints", True, "permutation")), output_rule="x's axes reordered"))
define(
    OpSpec(
        "view_permute",
        ("x",),
        _attrs(("shape", "ints_or_refs", True, "split_heads_shape"), ("dims", "ints", True, "result_permutation")),
        output_rule="permute(view(x, shape), dims) (a head split)",
    )
)
def _check_split_heads(instr: Instruction, graph: Graph) -> None:
    """The head groups tile x's last axis exactly: sum(heads) * head_dim == its width."""
    heads, dim = instr.attr("heads"), instr.attr("head_dim")
    assert isinstance(heads, tuple) and is_int(dim)
    if dim < 1 or any(not is_int(h) or h < 1 for h in heads) or len(heads) != len(instr.outputs):
        raise FormatError(f"instruction 'split_heads': head_dim must be >= 1 and heads one count >= 1 per result, "
                          f"got head_dim {dim}, heads {list(heads)} for {len(instr.outputs)} results")
    t = graph.slots[instr.inputs[0]].type  # type: ignore[index]
    if not isinstance(t, TensorType) or t.shape is None:
        return
    if len(t.shape) != 3:
        raise FormatError(f"instruction 'split_heads': x must be [B, T, W], got rank {len(t.shape)}")
    if is_int(t.shape[-1]) and sum(heads) * dim != t.shape[-1]:
        raise FormatError(f"instruction 'split_heads': heads {list(heads)} of {dim} do not tile x's last axis "
                          f"of {t.shape[-1]}")
    for count, slot in zip(heads, instr.outputs):
        r = graph.slots[slot].type
        if isinstance(r, TensorType) and r.shape is not None and (len(r.shape) != 4 or r.shape[1] != count
                                                                  or r.shape[3] != dim):  # fmt: skip
            raise FormatError(f"instruction 'split_heads': result slot {slot} must be [B, {count}, T, {dim}], "
                              f"the payload gives {list(r.shape)}")


define(
    OpSpec(
        "split_heads",
        ("x",),
        _attrs(("head_dim", "int"), ("heads", "ints")),
        n_outputs=None,
        output_rule="x [B, T, W] viewed as [B, T, W / head_dim, head_dim], heads moved ahead of tokens, and cut "
        "into consecutive groups of heads[i] heads: one result [B, heads[i], T, head_dim] each (the head split "
        "of a fused q/k/v projection)",
        check=_check_split_heads,
    )
)
define(
    OpSpec(
        "permute_view",
        ("x",),
        _attrs(("shape", "ints_or_refs", True, "view_shape"), ("dims", "ints", True, "permutation")),
        output_rule="view(permute(x, dims), shape) (a head merge)",
    )
)
define(
    OpSpec(
        "slice",
        ("x",),
        _attrs(("dim", "int", True, "axis"), ("start", "int_or_ref"), ("end", "int_or_ref"),
               ("step", "int", True, "nonzero")),
        output_rule="x[start:end:step] along dim, Python slice semantics (negatives wrap, ends clamp)",
    )
)
define(
    OpSpec(
        "slice_update",
        ("x", "update"),
        _attrs(("dim", "int", True, "axis"), ("start", "int_or_ref"), ("end", "int_or_ref"),
               ("step", "int", True, "nonzero")),
        output_rule="x with x[start:end:step] along dim (as in slice) replaced by update, which has that "
        "slice's shape and x's dtype",
    )
)
define(
    OpSpec(
        "select",
        ("x",),
        _attrs(("dim", "int", True, "axis"), ("index", "int_or_ref")),
        output_rule="x[index] along dim, dim removed (a negative index counts from the end)",
    )
)
define(OpSpec("unsqueeze", ("x",), _attrs(("dim", "int", True, "new_axis")),
              output_rule="x with a size-1 axis inserted at dim"))
define(OpSpec("squeeze", ("x",), _attrs(("dims", "ints", True, "squeeze_axes")),
              output_rule="x without those of dims that have size 1"))
define(
    OpSpec(
        "expand",
        ("x",),
        _attrs(("shape", "ints_or_refs", True, "expand_shape")),
        output_rule="x broadcast to shape (-1 keeps x's size; new axes lead)",
    )
)
define(
    OpSpec(
        "tile",
        ("x",),
        _attrs(("reps", "ints_or_refs", True, "tile_reps")),
        output_rule="x repeated reps[i] times along axis i; leading size-1 axes are added when reps is longer",
    )
)
define(OpSpec("cat", ("tensors*",), _attrs(("dim", "int", True, "cat_axis")),
              output_rule="the operands joined along dim"))
define(
    OpSpec(
        "split",
        ("x",),
        _attrs(("sizes", "ints_or_refs", True, "sizes"), ("dim", "int", True, "axis")),
        n_outputs=None,
        output_rule="one result per size: consecutive pieces of x along dim",
    )
)

# Creation.
define(
    OpSpec(
        "full",
        (),
        _attrs(("shape", "ints_or_refs", True, "result_shape"), ("value", "float"), ("dtype", "dtype")),
        output_rule="a tensor of the given shape and dtype filled with value",
    )
)
define(
    OpSpec(
        "arange",
        (),
        _attrs(("start", "int_or_ref"), ("end", "int_or_ref"), ("step", "int_or_ref", True, "nonzero"),
               ("dtype", "dtype")),
        output_rule="[start, start+step, ...) below end, 1-D, the given dtype",
    )
)

# Host integer arithmetic on dynamic sizes.
define(
    OpSpec(
        "sym_size",
        ("x",),
        _attrs(("dim", "int", True, "axis")),
        output_rule="int: x.shape[dim]",
        scalar_result=True,
    )
)
SCALAR_BINARY = ("scalar_add", "scalar_sub", "scalar_mul", "scalar_floordiv")
for _name in SCALAR_BINARY:
    define(
        OpSpec(
            _name,
            (),
            _attrs(("a", "int_or_ref"), ("b", "int_or_ref", True, "nonzero" if _name == "scalar_floordiv" else None)),
            output_rule="int: a op b (floor division rounds toward -inf)",
            scalar_result=True,
        )
    )

# The runtime-owned KV cache.
def _check_sinks(instr: Instruction, graph: Graph) -> None:
    if len(instr.inputs) < 5 or instr.inputs[4] is None:
        return
    q, sinks = (graph.slots[s].type for s in (instr.inputs[0], instr.inputs[4]))
    if isinstance(q, TensorType) and isinstance(sinks, TensorType) and q.shape is not None and sinks.shape is not None \
            and (len(q.shape) != 4 or tuple(sinks.shape) != (q.shape[1],)):  # fmt: skip
        raise FormatError(
            f"instruction 'update_and_attend': sinks must be [Hq] for q {list(q.shape)}, got {list(sinks.shape)}"
        )


define(
    OpSpec(
        "update_and_attend",
        ("q", "k", "v", "positions", "sinks?"),
        (AttrSpec("cache_id", "int"), AttrSpec("scale", "float"), AttrSpec("softcap", "float")),
        output_rule="[1, Hq, T, Dv]: q's shape with the last dim of v; dtype of q. sinks [Hq] (gpt-oss): one "
        "logit per query head that joins each softmax's denominator and attends to nothing "
        "(MLX: scaled_dot_product_attention(..., sinks=sinks))",
        check=_check_sinks,
    )
)


# Quantized weights (ir.quantization): ``linear`` and ``embedding`` with the weight operand
# replaced in place by its packed parts ``weight, scales, biases?`` (MLX's packing; biases
# for affine only), typed by ``(group_size, bits, mode)``. The logical weight is [N, K].
_QUANT_ATTRS = _attrs(("group_size", "int"), ("bits", "int"), ("mode", "str"))
define(
    OpSpec(
        "quantized_linear",
        ("x", "weight", "scales", "biases?", "bias?"),
        _QUANT_ATTRS,
        output_rule="x @ dequantize(weight, scales, biases).T (+ bias): x's shape with the last dim = N; "
        "dtype of x (MLX: quantized_matmul(x, weight, scales, biases, transpose=True, group_size, bits, mode))",
        check=quantization.check_operands,
    )
)
define(
    OpSpec(
        "quantized_embedding",
        ("weight", "scales", "biases?", "indices"),
        _QUANT_ATTRS + _attrs(("dtype", "dtype")),
        output_rule="indices.shape + [K]: the rows indices select, dequantized to dtype (MLX: take the rows "
        "of each part, then dequantize(rows, scales rows, biases rows, group_size, bits, mode, dtype))",
        check=quantization.check_operands,
    )
)


# Collectives: never written by the exporter; the loader inserts one after every
# row-parallel linear when it shards a program over several processes (``ir.sharding``).
# ``group`` names the process group in the interpreter's registry (``interpreter.groups``).
define(
    OpSpec(
        "all_sum",
        ("x",),
        _attrs(("group", "int")),
        output_rule="same dtype and shape as x: the elementwise sum of x over every rank of the group "
        "(MLX: mx.distributed.all_sum(x, group=group))",
    )
)

# Norms fused into the linear that reads them: never written by the exporter; the loader
# merges an rms_norm read only by one linear (and the residual add it normalizes, whose
# sum stays a result for the layer's later reads) into one op (``ir.norm_linears``), which
# a GPU runs as one kernel.
define(
    OpSpec(
        "rms_norm_linear",
        ("x", "norm_weight", "weight", "bias?"),
        _attrs(("eps", "float")),
        output_rule="linear(rms_norm(x, norm_weight, eps), weight, bias), by those ops' rules",
    )
)
define(
    OpSpec(
        "add_rms_norm_linear",
        ("a", "b", "norm_weight", "weight", "bias?"),
        _attrs(("eps", "float")),
        n_outputs=2,
        output_rule="(linear(rms_norm(a + b, norm_weight, eps), weight, bias), a + b), by those ops' rules",
    )
)
define(
    OpSpec(
        "rms_norm_quantized_linear",
        ("x", "norm_weight", "weight", "scales", "biases?", "bias?"),
        (*_attrs(("eps", "float")), *_QUANT_ATTRS),
        output_rule="quantized_linear(rms_norm(x, norm_weight, eps), weight, scales, biases, bias), by those ops' "
        "rules",
        check=quantization.check_operands,
    )
)
define(
    OpSpec(
        "add_rms_norm_quantized_linear",
        ("a", "b", "norm_weight", "weight", "scales", "biases?", "bias?"),
        (*_attrs(("eps", "float")), *_QUANT_ATTRS),
        n_outputs=2,
        output_rule="(quantized_linear(rms_norm(a + b, norm_weight, eps), weight, scales, biases, bias), a + b), by "
        "those ops' rules",
        check=quantization.check_operands,
    )
)

# A GLU fused into the linear that reads it: never written by the exporter; the loader
# merges a glu read only by one linear into one op (``ir.glu_linears``), which a GPU runs as
# one kernel.
define(
    OpSpec(
        "glu_linear",
        ("gate", "up?", "weight", "bias?"),
        _GLU_ATTRS,
        output_rule="linear(glu(gate, up, activation, width), weight, bias), by those ops' rules",
        check=_check_glu_halves,
    )
)


def _check_glu_quantized_linear(instr: Instruction, graph: Graph) -> None:
    _check_glu_halves(instr, graph)
    quantization.check_operands(instr, graph)


define(
    OpSpec(
        "glu_quantized_linear",
        ("gate", "up?", "weight", "scales", "biases?", "bias?"),
        (*_GLU_ATTRS, *_QUANT_ATTRS),
        output_rule="quantized_linear(glu(gate, up, activation, width), weight, scales, biases, bias), by those "
        "ops' rules",
        check=_check_glu_quantized_linear,
    )
)
