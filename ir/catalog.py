"""The op catalog: every op a graph may contain, shared by the lowering (which emits
instructions) and the interpreter (which runs them).

An entry states the op's operands (in order; optional ones may be omitted as None), its
attributes with their kinds and rules (``RULES``: e.g. an axis of the operand, a
permutation, sizes that match the declared result), how many results it produces, and
its output rule (the result's dtype and shape in terms of the operands), so a payload
can be validated structurally before anything runs.

Conventions every entry follows (the lowering guarantees them, so handlers need not
promote): operands of elementwise ops already share the result's dtype (the lowering
inserts ``cast``); dims are non-negative; shapes may hold ``SlotRef``s to int scalar
slots (dynamic sizes) and ``-1`` where the op allows it.
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Callable, Optional

from . import quantization
from .errors import FormatError, UnknownOpError
from .catalog_rules import RULES, Shapes, is_int
from .graph import DTYPES, Graph, Instruction, ScalarType, SlotRef, TensorType

# Attribute kinds and the Python values they accept.
ATTR_KINDS = ("int", "float", "bool", "str", "dtype", "ints", "floats", "int_or_ref", "ints_or_refs")


@dataclass(frozen=True)
class AttrSpec:
    """An attribute: its kind, and optionally a ``rule`` (a name in ``RULES``) its value obeys
    given the instruction's operands and results (e.g. "axis": an axis of the first operand)."""

    name: str
    kind: str
    required: bool = True
    rule: Optional[str] = None
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpSpec:
    """One op's signature.

    ``operands``: a trailing ``?`` marks an optional operand (optional operands at the end may
    be left out of an instruction altogether, so adding one keeps older files valid and their
    bytes unchanged); a single operand named with a
    trailing ``*`` takes one or more slots (``cat``). ``n_outputs`` None means one or more
    results (``split``: one per size). ``scalar_result``: the results are int scalar slots
    (sizes computed on the host), not tensors. ``check``: further rules of the op, run
    after the structural ones (raises FormatError).
    """

    name: str
    operands: tuple[str, ...]
    attrs: tuple[AttrSpec, ...] = ()
    n_outputs: Optional[int] = 1
    output_rule: str = "same dtype and shape as the first operand"
    scalar_result: bool = False
    check: Optional[Callable[[Instruction, Graph], None]] = None

    @property
    def variadic(self) -> bool:
        return len(self.operands) == 1 and self.operands[0].endswith("*")

    def validate(self, instr: Instruction, graph: Graph, index: Optional[int] = None) -> None:
        """Raise FormatError if ``instr`` (``index`` in the graph, when given) does not fit this
        op's signature and attribute rules."""
        where = f"instruction {self.name!r}" if index is None else f"instruction {index} ({self.name!r})"
        if self.variadic:
            names = (self.operands[0],) * len(instr.inputs)
            if not instr.inputs:
                raise FormatError(f"{where} takes one or more operands, the payload gives none")
        else:
            names = self.operands
            required = len(self.operands)
            while required and self.operands[required - 1].endswith("?"):
                required -= 1
            if not required <= len(instr.inputs) <= len(self.operands):
                takes = f"{required} to {len(self.operands)}" if required < len(self.operands) else f"{required}"
                raise FormatError(f"{where} takes {takes} operands, the payload gives {len(instr.inputs)}")
        for name, slot in zip(names, instr.inputs):
            if slot is None:
                if not name.endswith("?"):
                    raise FormatError(f"{where}: required operand {name!r} is missing")
                continue
            if not 0 <= slot < len(graph.slots):
                raise FormatError(f"{where}: operand {name!r} refers to slot {slot}, which does not exist")
            if not isinstance(graph.slots[slot].type, TensorType):
                raise FormatError(f"{where}: operand {name!r} (slot {slot}) must be a tensor")
        if self.n_outputs is None and not instr.outputs:
            raise FormatError(f"{where} produces one or more results, the payload gives none")
        if self.n_outputs is not None and len(instr.outputs) != self.n_outputs:
            raise FormatError(f"{where} produces {self.n_outputs} results, the payload gives {len(instr.outputs)}")
        result_type = ScalarType if self.scalar_result else TensorType
        for slot in instr.outputs:
            if not 0 <= slot < len(graph.slots):
                raise FormatError(f"{where}: result slot {slot} does not exist")
            if not isinstance(graph.slots[slot].type, result_type):
                raise FormatError(f"{where}: result slot {slot} must be a {result_type.__name__}")
        known = {a.name: a for a in self.attrs}
        given = dict(instr.attrs)
        shapes = Shapes(instr, graph)
        for name in given:
            if name not in known:
                raise FormatError(f"{where}: unknown attribute {name!r}")
        for spec in self.attrs:
            if spec.name not in given or given[spec.name] is None:
                if spec.required:
                    raise FormatError(f"{where}: attribute {spec.name!r} is missing")
                continue
            _check_attr(where, spec, given[spec.name], graph)
            if shapes.typed:
                _check_rule(where, spec, given[spec.name], shapes)
        if self.check is not None:
            try:
                self.check(instr, graph)
            except FormatError as exc:
                # The op's own checks name the op; the graph's index is only known here.
                message, unnamed = str(exc), f"instruction {self.name!r}"
                if index is None or not message.startswith(unnamed):
                    raise
                raise FormatError(where + message[len(unnamed):]) from None


def _check_attr(where: str, spec: AttrSpec, value: object, graph: Graph) -> None:
    def ref_ok(v: object) -> bool:
        return (
            isinstance(v, SlotRef)
            and 0 <= v.slot < len(graph.slots)
            and graph.slots[v.slot].type == ScalarType("int")
        )

    ok = {
        "int": is_int,
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "dtype": lambda v: v in DTYPES,
        "ints": lambda v: isinstance(v, tuple) and all(is_int(x) for x in v),
        "floats": lambda v: isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v),
        "int_or_ref": lambda v: is_int(v) or ref_ok(v),
        "ints_or_refs": lambda v: isinstance(v, tuple) and all(is_int(x) or ref_ok(x) for x in v),
    }[spec.kind]
    if not ok(value):
        expected = f"one of {', '.join(DTYPES)}" if spec.kind == "dtype" else spec.kind
        raise FormatError(f"{where}: attribute {spec.name!r} must be {expected}, got {value!r}")
    if spec.choices and value not in spec.choices:
        choices = ", ".join(spec.choices)
        raise FormatError(f"{where}: attribute {spec.name!r} must be one of {choices}, got {value!r}")


def _check_rule(where: str, spec: AttrSpec, value: object, shapes: Shapes) -> None:
    if spec.rule is None:
        return
    problem = RULES[spec.rule](value, shapes)
    if problem:
        raise FormatError(f"{where}: attribute {spec.name!r} = {value!r} {problem}")


CATALOG: dict[str, OpSpec] = {}


def define(spec: OpSpec) -> OpSpec:
    for attr in spec.attrs:
        if attr.kind not in ATTR_KINDS:
            raise ValueError(f"op {spec.name}: unknown attribute kind {attr.kind!r}")
        if attr.rule is not None and attr.rule not in RULES:
            raise ValueError(f"op {spec.name}: unknown attribute rule {attr.rule!r}")
    if spec.name in CATALOG:
        raise ValueError(f"op {spec.name} is defined twice")
    CATALOG[spec.name] = spec
    return spec


def lookup(name: str) -> OpSpec:
    try:
        return CATALOG[name]
    except KeyError:
        raise UnknownOpError(
            f"unknown op {name!r}: this file needs a newer mlx-pte (or was not written by it)"
        ) from None


def validate_graph(graph: Graph) -> None:
    """Structural check of every instruction against the catalog.

    (Dataflow order and slot types are checked with the payload: ``ir.payload.check_graph``.)
    """
    for index, instr in enumerate(graph.instructions):
        lookup(instr.op).validate(instr, graph, index)


# -- the ops -------------------------------------------------------------------------
def _attrs(*specs: tuple) -> tuple[AttrSpec, ...]:
    return tuple(AttrSpec(*s) for s in specs)


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
        raise FormatError("instruction 'glu': attribute 'width' belongs with a fused gate/up operand (up left "
                          "out), and only there")
    t = graph.slots[instr.inputs[0]].type  # type: ignore[index]
    total = t.shape[-1] if isinstance(t, TensorType) and t.shape else None
    if fused and (not is_int(width) or width < 1 or (is_int(total) and 2 * width > total)):
        raise FormatError(f"instruction 'glu': width {width} must be >= 1 and fit twice in the fused operand's "
                          f"last axis of {total}")


define(
    OpSpec(
        "glu",
        ("gate", "up?"),
        _attrs(("activation", "str", True, None, ("silu", "gelu", "gelu_tanh")), ("width", "int", False)),
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


# The op families kept in modules of their own define themselves on import; they build on
# ``define`` above. UPSTREAM_ONLY: the ops only imported upstream programs use.
from . import catalog_moe  # noqa: E402,F401
from .catalog_upstream import UPSTREAM_ONLY  # noqa: E402,F401
