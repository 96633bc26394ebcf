"""Translations of upstream MLX node types into mlx-pte's op catalog.

Each translation reads one flatc node object and emits catalog instructions through the
``ImportBuilder``; the table below is the whole list of node types mlx-pte runs. Upstream's
runtime computes with MLX's own type promotion, as mlx-pte's MLX handlers do, so
operands are passed through unchanged.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from ..errors import FormatError
from .builder import ImportBuilder

Translation = Callable[[ImportBuilder, Any], None]
TRANSLATIONS: dict[str, Translation] = {}

_UNARY = {
    "NegNode": "neg", "AbsNode": "abs", "ExpNode": "exp", "LogNode": "log", "SqrtNode": "sqrt",
    "RsqrtNode": "rsqrt", "SinNode": "sin", "CosNode": "cos", "TanhNode": "tanh",
    "SigmoidNode": "sigmoid", "SiluNode": "silu", "ErfNode": "erf", "ReciprocalNode": "reciprocal",
    "LogicalNotNode": "logical_not", "FloorNode": "floor", "CeilNode": "ceil", "TruncNode": "trunc",
    "TanNode": "tan", "ArcsinNode": "asin", "ArccosNode": "acos", "ArctanNode": "atan", "SinhNode": "sinh",
    "CoshNode": "cosh", "ArcsinhNode": "asinh", "ArccoshNode": "acosh", "ArctanhNode": "atanh",
    "Log2Node": "log2", "Log10Node": "log10", "Log1pNode": "log1p", "Expm1Node": "expm1", "SignNode": "sign",
    "BitwiseInvertNode": "bitwise_not",
}  # fmt: skip
_BINARY = {
    "AddNode": "add", "SubtractNode": "sub", "MultiplyNode": "mul", "DivideNode": "div",
    "PowerNode": "pow", "MaximumNode": "maximum", "MinimumNode": "minimum", "LessNode": "lt",
    "LessEqualNode": "le", "GreaterNode": "gt", "GreaterEqualNode": "ge", "EqualNode": "eq",
    "NotEqualNode": "ne", "LogicalAndNode": "logical_and", "LogicalOrNode": "logical_or",
    "Atan2Node": "atan2", "LogAddExpNode": "logaddexp", "FloorDivideNode": "floor_divide",
    "RemainderNode": "remainder", "BitwiseAndNode": "bitwise_and", "BitwiseOrNode": "bitwise_or",
    "BitwiseXorNode": "bitwise_xor",
}  # fmt: skip
_REDUCTIONS = {
    "SumNode": "sum", "MeanNode": "mean", "MaxNode": "amax", "MinNode": "amin", "ProdNode": "prod",
    "LogSumExpNode": "logsumexp", "AnyNode": "any", "AllNode": "all", "VarNode": "var", "StdNode": "std",
}  # fmt: skip
_SCALAR = {
    "AddIntNode": "scalar_add", "SubtractIntNode": "scalar_sub",
    "MultiplyIntNode": "scalar_mul", "FloorDivideIntNode": "scalar_floordiv",
}  # fmt: skip


def _ints(values: Any) -> tuple[int, ...]:
    """An int vector (flatc gives numpy arrays) as Python ints."""
    return tuple(int(v) for v in values)


def translates(*names: str) -> Callable[[Translation], Translation]:
    def register(fn: Translation) -> Translation:
        for name in names:
            TRANSLATIONS[name] = fn
        return fn

    return register


def _unary(op: str) -> Translation:
    return lambda b, n: b.emit(op, (b.read(n.x),), (b.write(n.out),))


def _binary(op: str) -> Translation:
    return lambda b, n: b.emit(op, (b.read(n.a), b.read(n.b)), (b.write(n.out),))


def _reduction(op: str) -> Translation:
    def translate(b: ImportBuilder, n: Any) -> None:
        x = b.read(n.x)
        extra = {"ddof": n.ddof} if op in ("var", "std") else {}
        if n.axes is not None and len(n.axes):
            b.emit(op, (x,), (b.write(n.out),), dims=_ints(n.axes), keepdim=bool(n.keepdims), **extra)
            return
        # Over every axis (no axes given): of the flattened values; keepdims gives the
        # result the operand's rank, which only the result's recorded type says.
        flat = b.temp()
        b.emit("view", (x,), (flat,), shape=(-1,))
        if not n.keepdims:
            b.emit(op, (flat,), (b.write(n.out),), dims=(0,), keepdim=False, **extra)
            return
        shape = b.recorded_shape(n.out)
        if shape is None:
            raise FormatError(f"a {op} over every axis keeping dims needs the result's rank, which is not recorded")
        reduced = b.temp()
        b.emit(op, (flat,), (reduced,), dims=(0,), keepdim=True, **extra)
        b.emit("view", (reduced,), (b.write(n.out),), shape=(1,) * len(shape))

    return translate


def _scalar(op: str) -> Translation:
    return lambda b, n: b.emit(op, (), (b.write_value(n.out),), a=b.int_or_ref(n.a), b=b.int_or_ref(n.b))


for _table, _make in ((_UNARY, _unary), (_BINARY, _binary), (_REDUCTIONS, _reduction), (_SCALAR, _scalar)):
    for _node, _op in _table.items():
        TRANSLATIONS[_node] = _make(_op)


@translates("NoopNode")
def _noop(b: ImportBuilder, n: Any) -> None:
    pass


@translates("IdCopyNode", "ContiguousNode")
def _alias(b: ImportBuilder, n: Any) -> None:
    b.alias(n.out, n.x)  # MLX arrays are immutable values: a copy is the same value


@translates("SquareNode")
def _square(b: ImportBuilder, n: Any) -> None:
    x = b.read(n.x)
    b.emit("mul", (x, x), (b.write(n.out),))


@translates("WhereNode")
def _where(b: ImportBuilder, n: Any) -> None:
    b.emit("where", (b.read(n.condition), b.read(n.x), b.read(n.y)), (b.write(n.out),))


@translates("GeluNode")
def _gelu(b: ImportBuilder, n: Any) -> None:
    approximate = b.text(n.approximate)
    if approximate not in ("none", "tanh"):
        raise FormatError(f"GeluNode approximation {approximate!r} is not 'none' or 'tanh'")
    b.emit("gelu", (b.read(n.x),), (b.write(n.out),), approximate=approximate)


@translates("AsTypeNode")
def _as_type(b: ImportBuilder, n: Any) -> None:
    b.emit("cast", (b.read(n.x),), (b.write(n.out),), dtype=b.dtype(n.scalarType))


@translates("SoftmaxNode")
def _softmax(b: ImportBuilder, n: Any) -> None:
    b.emit("softmax", (b.read(n.x),), (b.write(n.out),), dim=n.axis)


@translates("ArgmaxNode")
def _argmax(b: ImportBuilder, n: Any) -> None:
    b.emit("argmax", (b.read(n.x),), (b.write(n.out),), dim=n.axis, keepdim=bool(n.keepdims))


@translates("RMSNormNode")
def _rms_norm(b: ImportBuilder, n: Any) -> None:
    b.emit("rms_norm", (b.read(n.x), b.read_optional(n.weight)), (b.write(n.out),), eps=float(n.eps))


@translates("LayerNormNode")
def _layer_norm(b: ImportBuilder, n: Any) -> None:
    inputs = (b.read(n.x), b.read_optional(n.weight), b.read_optional(n.bias))
    b.emit("layer_norm", inputs, (b.write(n.out),), eps=float(n.eps))


@translates("AddmmNode")
def _addmm(b: ImportBuilder, n: Any) -> None:
    """alpha * (mat1 @ mat2) + beta * bias; a stored weight's transpose runs as ``linear``."""
    x, mat2, bias = b.read(n.mat1), b.read(n.mat2), b.read_optional(n.bias)
    weight = b.transposed_constant(n.mat2)
    plain = n.alpha == 1.0 and (bias is None or n.beta == 1.0)
    if plain and weight is not None:
        b.emit("linear", (x, weight, bias), (b.write(n.out),))
        return
    product = b.write(n.out) if plain and bias is None else b.temp()
    if weight is not None:
        b.emit("linear", (x, weight, None), (product,))
    else:
        b.emit("matmul", (x, mat2), (product,))
    if plain:
        if bias is not None:
            b.emit("add", (product, bias), (b.write(n.out),))
        return
    # Scalars need the operands' dtype, which the payload records only for constants.
    dtype = b.constant_dtype(weight if weight is not None else mat2)
    if dtype is None:
        raise FormatError("AddmmNode with alpha or beta other than 1 is supported only on a stored weight")
    scaled = b.scaled(product, n.alpha, dtype)
    if bias is None:
        b.assign(n.out, scaled)
    else:
        b.emit("add", (scaled, b.scaled(bias, n.beta, dtype)), (b.write(n.out),))


@translates("TransposeNode")
def _transpose(b: ImportBuilder, n: Any) -> None:
    x = b.read(n.x)
    out = b.write(n.out)
    b.emit("permute", (x,), (out,), dims=_ints(n.perm))
    b.note_transpose(out, x, _ints(n.perm))


@translates("ReshapeNode")
def _reshape(b: ImportBuilder, n: Any) -> None:
    b.emit("view", (b.read(n.x),), (b.write(n.out),), shape=b.ints_or_refs(n.shape))


@translates("BroadcastToNode")
def _broadcast_to(b: ImportBuilder, n: Any) -> None:
    b.emit("expand", (b.read(n.x),), (b.write(n.out),), shape=b.ints_or_refs(n.shape))


@translates("TileNode")
def _tile(b: ImportBuilder, n: Any) -> None:
    b.emit("tile", (b.read(n.x),), (b.write(n.out),), reps=b.ints_or_refs(n.reps))


@translates("ExpandDimsNode")
def _expand_dims(b: ImportBuilder, n: Any) -> None:
    b.emit("unsqueeze", (b.read(n.x),), (b.write(n.out),), dim=n.axis)


@translates("SqueezeNode")
def _squeeze(b: ImportBuilder, n: Any) -> None:
    if n.dims is not None and len(n.dims):
        b.emit("squeeze", (b.read(n.x),), (b.write(n.out),), dims=_ints(n.dims))
        return
    # Every size-1 axis: which ones only the result's recorded shape says (one dynamic size at most).
    shape = b.recorded_shape(n.out)
    if shape is None or shape.count(-1) > 1:
        raise FormatError("a SqueezeNode without dims (squeeze every size-1 axis) is supported on a result of "
                          "recorded shape only")  # fmt: skip
    b.emit("view", (b.read(n.x),), (b.write(n.out),), shape=shape)


@translates("SliceNode")
def _slice(b: ImportBuilder, n: Any) -> None:
    attrs = dict(dim=b.static_int(n.axis, "SliceNode axis"), start=b.int_or_ref(n.start),
                 end=b.int_or_ref(n.stop), step=n.step)  # fmt: skip
    b.emit("slice", (b.read(n.x),), (b.write(n.out),), **attrs)


@translates("SliceUpdateNode")
def _slice_update(b: ImportBuilder, n: Any) -> None:
    attrs = dict(dim=b.static_int(n.axis, "SliceUpdateNode axis"), start=b.int_or_ref(n.start),
                 end=b.int_or_ref(n.stop), step=n.step)  # fmt: skip
    b.emit("slice_update", (b.read(n.dst), b.read(n.update)), (b.write(n.out),), **attrs)


@translates("ConcatenateNode")
def _concatenate(b: ImportBuilder, n: Any) -> None:
    b.emit("cat", tuple(b.read(t) for t in n.tensors or ()), (b.write(n.out),), dim=n.axis)


@translates("SplitNode")
def _split(b: ImportBuilder, n: Any) -> None:
    outputs = tuple(b.write(t) for t in n.outs or ())
    sizes = b.ints_or_refs(n.sizes)
    if len(sizes) == 1:  # torch.split(x, size): pieces of one size, the last one what remains
        sizes *= len(outputs)
    b.emit("split", (b.read(n.x),), outputs, sizes=sizes, dim=n.axis)


_TAKE_LITERAL, _TAKE_VID, _TAKE_TID = 0, 1, 2


@translates("TakeNode")
def _take(b: ImportBuilder, n: Any) -> None:
    index = n.index
    x = b.read(n.x)
    if index.kind == _TAKE_TID:
        indices = b.read(index.tid)
        # Axis 0 with indices of any shape is an embedding lookup (mx.take either way).
        op, attrs = ("embedding", {}) if n.axis == 0 else ("index_select", {"dim": n.axis})
        out = b.write(n.out)
        b.emit(op, (x, indices), (out,), **attrs)
        if n.axis == 0:
            b.note_rows(out, x, indices)
    elif index.kind in (_TAKE_LITERAL, _TAKE_VID):
        value = index.literal if index.kind == _TAKE_LITERAL else b.value(index.vid)
        b.emit("select", (x,), (b.write(n.out),), dim=n.axis, index=value)
    else:
        raise FormatError(f"TakeNode index kind {index.kind} is not a literal, value or tensor")


@translates("TakeAlongAxisNode")
def _take_along_axis(b: ImportBuilder, n: Any) -> None:
    b.emit("gather", (b.read(n.x), b.read(n.indices)), (b.write(n.out),), dim=n.axis)


@translates("SymSizeNode")
def _sym_size(b: ImportBuilder, n: Any) -> None:
    b.emit("sym_size", (b.read(n.a),), (b.write_value(n.out),), dim=n.dim)


@translates("FullNode")
def _full(b: ImportBuilder, n: Any) -> None:
    attrs = dict(shape=b.ints_or_refs(n.shape), value=b.static_float(n.v, "FullNode value"),
                 dtype=b.dtype(n.scalarType))  # fmt: skip
    b.emit("full", (), (b.write(n.out),), **attrs)


@translates("ARangeNode")
def _arange(b: ImportBuilder, n: Any) -> None:
    if n.scalarType is None:
        raise FormatError("an ARangeNode without a dtype is not supported")
    attrs = dict(start=b.int_or_ref(n.start), end=b.int_or_ref(n.stop), step=b.int_or_ref(n.step),
                 dtype=b.dtype(n.scalarType))  # fmt: skip
    b.emit("arange", (), (b.write(n.out),), **attrs)


@translates("UpdateAndAttendNode")
def _update_and_attend(b: ImportBuilder, n: Any) -> None:
    cache_id = b.cache_id(n.layerId)
    inputs = (b.read(n.q), b.read(n.k), b.read(n.v), b.read(n.position))
    attrs = dict(cache_id=cache_id, scale=float(n.scale), softcap=0.0)
    if n.outDtype is None:
        b.emit("update_and_attend", inputs, (b.write(n.out),), **attrs)
        return
    attended = b.temp()
    b.emit("update_and_attend", inputs, (attended,), **attrs)
    b.emit("cast", (attended,), (b.write(n.out),), dtype=b.dtype(n.outDtype))


@translates("ClipNode")
def _clip(b: ImportBuilder, n: Any) -> None:
    """min(max(x, a_min), a_max), either bound optional (the bounds are tensors)."""
    value = b.read(n.x)
    bounds = [("maximum", b.read_optional(n.aMin)), ("minimum", b.read_optional(n.aMax))]
    bounds = [(op, slot) for op, slot in bounds if slot is not None]
    if not bounds:
        b.alias(n.out, n.x)
        return
    for i, (op, bound) in enumerate(bounds):
        out = b.write(n.out) if i == len(bounds) - 1 else b.temp()
        b.emit(op, (value, bound), (out,))
        value = out


@translates("StackNode")
def _stack(b: ImportBuilder, n: Any) -> None:
    pieces = []
    for tid in n.tensors or ():
        piece = b.temp()
        b.emit("unsqueeze", (b.read(tid),), (piece,), dim=n.axis)
        pieces.append(piece)
    b.emit("cat", tuple(pieces), (b.write(n.out),), dim=n.axis)


@translates("ArgminNode")
def _argmin(b: ImportBuilder, n: Any) -> None:
    negated = b.temp()  # the first minimum of x is the first maximum of -x
    b.emit("neg", (b.read(n.x),), (negated,))
    b.emit("argmax", (negated,), (b.write(n.out),), dim=n.axis, keepdim=bool(n.keepdims))


@translates("RoundNode")
def _round(b: ImportBuilder, n: Any) -> None:
    b.emit("round", (b.read(n.x),), (b.write(n.out),), decimals=n.decimals)


@translates("TrilNode", "TriuNode")
def _triangle(b: ImportBuilder, n: Any) -> None:
    op = "tril" if type(n).__name__ == "TrilNodeT" else "triu"
    b.emit(op, (b.read(n.x),), (b.write(n.out),), k=n.k)


@translates("CumsumNode")
def _cumsum(b: ImportBuilder, n: Any) -> None:
    attrs = dict(dim=n.axis, reverse=bool(n.reverse), inclusive=bool(n.inclusive))
    b.emit("cumsum", (b.read(n.x),), (b.write(n.out),), **attrs)


@translates("RollNode")
def _roll(b: ImportBuilder, n: Any) -> None:
    shifts, dims = b.ints_or_refs(n.shift), _ints(n.axes if n.axes is not None else ())
    if len(shifts) != len(dims):
        raise FormatError(f"a RollNode gives {len(shifts)} shifts for {len(dims)} axes")
    b.emit("roll", (b.read(n.x),), (b.write(n.out),), shifts=shifts, dims=dims)


@translates("FullLikeNode")
def _full_like(b: ImportBuilder, n: Any) -> None:
    attrs = dict(value=b.static_float(n.v, "FullLikeNode value"))
    if n.scalarType is not None:
        attrs["dtype"] = b.dtype(n.scalarType)
    b.emit("full_like", (b.read(n.x),), (b.write(n.out),), **attrs)


@translates("SortNode", "ArgsortNode")
def _sort(b: ImportBuilder, n: Any) -> None:
    op = "sort" if type(n).__name__ == "SortNodeT" else "argsort"
    b.emit(op, (b.read(n.x),), (b.write(n.out),), dim=n.axis)


@translates("PartitionNode", "ArgPartitionNode")
def _partition(b: ImportBuilder, n: Any) -> None:
    op = "partition" if type(n).__name__ == "PartitionNodeT" else "argpartition"
    b.emit(op, (b.read(n.x),), (b.write(n.out),), kth=b.int_or_ref(n.kth), dim=n.axis)


@translates("FlipNode")
def _flip(b: ImportBuilder, n: Any) -> None:
    b.emit("flip", (b.read(n.x),), (b.write(n.out),), dims=_ints(n.axes if n.axes is not None else ()))


@translates("RepeatNode")
def _repeat(b: ImportBuilder, n: Any) -> None:
    b.emit("repeat_interleave", (b.read(n.x),), (b.write(n.out),), repeats=b.int_or_ref(n.repeats), dim=n.axis)


@translates("PadNode")
def _pad(b: ImportBuilder, n: Any) -> None:
    widths = b.ints_or_refs(n.padWidth)
    mode = b.text(n.mode)
    if len(widths) % 2 or mode not in ("constant", "edge"):
        raise FormatError(f"a PadNode needs (before, after) pairs and mode constant or edge, got {len(widths)} "
                          f"widths and mode {mode!r}")  # fmt: skip
    b.emit("pad", (b.read(n.x),), (b.write(n.out),), widths=widths, mode=mode, value=float(n.constantValue))


@translates("SdpaNode")
def _sdpa(b: ImportBuilder, n: Any) -> None:
    inputs = (b.read(n.q), b.read(n.k), b.read(n.v), b.read_optional(n.mask))
    b.emit("sdpa", inputs, (b.write(n.out),), scale=float(n.scale), causal=bool(n.causal))


@translates("ScatterAddNode")
def _scatter_add(b: ImportBuilder, n: Any) -> None:
    inputs = (b.read(n.x), b.read(n.indices), b.read(n.updates))
    b.emit("scatter_add", inputs, (b.write(n.out),), dim=n.axis)


def _quantization(b: ImportBuilder, n: Any) -> dict[str, Any]:
    return dict(group_size=n.groupSize, bits=n.bits, mode=b.text(n.mode))


@translates("QuantizedMatmulNode")
def _quantized_matmul(b: ImportBuilder, n: Any) -> None:
    """x @ dequantize(w).T on a stored quantized weight: ``quantized_linear``."""
    if not n.transpose:
        raise FormatError("a QuantizedMatmulNode without transpose (a weight stored [K, N]) is not supported")
    parts = (b.read(n.w), b.read(n.scales), b.read_optional(n.biases))
    if any(p is not None and b.constant_dtype(p) is None for p in parts):
        raise FormatError("a QuantizedMatmulNode reads a quantized weight computed at run time; "
                          "mlx-pte runs stored quantized weights only")  # fmt: skip
    b.emit("quantized_linear", (b.read(n.x), *parts, None), (b.write(n.out),), **_quantization(b, n))


@translates("DequantizeNode")
def _dequantize(b: ImportBuilder, n: Any) -> None:
    """Rows gathered from each part of a stored quantized weight by the same indices, then
    dequantized (upstream's quantized embedding): ``quantized_embedding``."""
    if n.globalScale is not None:
        raise FormatError("a DequantizeNode with a global scale is not supported")
    tids = (n.w, n.scales) + (() if n.biases is None else (n.biases,))
    rows = [b.constant_rows(t) for t in tids]
    if any(r is None for r in rows) or len({r[1] for r in rows}) != 1:
        raise FormatError(
            "a DequantizeNode is supported on rows one index tensor gathers from each part of a stored "
            "quantized weight (a quantized embedding) only"
        )
    weight, scales = rows[0][0], rows[1][0]
    biases = rows[2][0] if len(rows) == 3 else None
    if n.dtype is not None:
        dtype = b.dtype(n.dtype)
    elif biases is not None:  # affine: MLX dequantizes to the scales' dtype
        dtype = b.constant_dtype(scales)
    else:
        raise FormatError(f"a DequantizeNode of {b.text(n.mode)} weights must give its dtype")
    inputs = (weight, scales, biases, rows[0][1])
    b.emit("quantized_embedding", inputs, (b.write(n.out),), dtype=dtype, **_quantization(b, n))


def translation(name: str) -> Optional[Translation]:
    return TRANSLATIONS.get(name)


from . import nodes_moe  # noqa: E402,F401  (registers the MoE translations; it builds on translates above)
