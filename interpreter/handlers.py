"""One MLX handler per catalog op.

A handler takes the instruction's operand values (MLX arrays, or None for an omitted
optional operand), its attributes with every ``SlotRef`` already resolved to an int, and
the run's context; it returns the result (a tuple when the op has several, an int for
scalar ops). Handlers build lazy MLX graphs and never evaluate: the program evaluates
once per run. The lowering has already promoted operands (see ``ir.catalog``), so
handlers do no type promotion of their own.

This module holds the registry and the core families (elementwise, reductions and norms,
linear algebra and indexing, layout, creation, host integers, the KV cache, quantized
weights); ``rope_handlers``, ``moe_handlers`` and ``upstream_handlers`` (ops only imported
upstream programs use) register theirs on import, at the end of this one.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

from mlx_pte.runtime.mlx.bootstrap import mx
from mlx_pte.runtime.mlx import gemv

from mlx_pte.ir.catalog import CATALOG

from .groups import all_sum

MX_DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "int64": mx.int64,
    "int32": mx.int32,
    "int16": mx.int16,
    "int8": mx.int8,
    "uint8": mx.uint8,
    "bool": mx.bool_,
    "uint32": mx.uint32,
}


class MissingCacheError(RuntimeError):
    """A program with attention layers ran without a KV cache."""


@dataclass
class RunContext:
    """What a run carries besides slot values: the KV cache the caller declared a step on."""

    cache: Any = None


Args = list[Optional[mx.array]]
Handler = Callable[[Args, dict[str, Any], RunContext], Any]

HANDLERS: dict[str, Handler] = {}


def handles(*names: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for name in names:
            HANDLERS[name] = fn
        return fn

    return register


def on_operands(fn: Callable[..., mx.array]) -> Handler:
    return lambda args, attrs, ctx: fn(*args)


def _half_precision(x: mx.array) -> bool:
    return x.dtype in (mx.float16, mx.bfloat16)


# -- elementwise -----------------------------------------------------------------------
_UNARY = {
    "neg": mx.negative,
    "abs": mx.abs,
    "exp": mx.exp,
    "log": mx.log,
    "sqrt": mx.sqrt,
    "rsqrt": mx.rsqrt,
    "sin": mx.sin,
    "cos": mx.cos,
    "tanh": mx.tanh,
    "sigmoid": mx.sigmoid,
    "relu": lambda x: mx.maximum(x, 0),
    "silu": lambda x: _silu(x),
    "erf": mx.erf,
    "reciprocal": mx.reciprocal,
    "logical_not": mx.logical_not,
}
_BINARY = {
    "add": mx.add,
    "sub": mx.subtract,
    "mul": mx.multiply,
    "div": mx.divide,
    "pow": mx.power,
    "maximum": mx.maximum,
    "minimum": mx.minimum,
    "lt": mx.less,
    "le": mx.less_equal,
    "gt": mx.greater,
    "ge": mx.greater_equal,
    "eq": mx.equal,
    "ne": mx.not_equal,
    "logical_and": mx.logical_and,
    "logical_or": mx.logical_or,
}
for _name, _fn in {**_UNARY, **_BINARY}.items():
    HANDLERS[_name] = on_operands(_fn)
HANDLERS["where"] = on_operands(mx.where)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_erf(x: mx.array) -> mx.array:
    return 0.5 * x * (1 + mx.erf(x / math.sqrt(2.0)))


def _gelu_tanh(x: mx.array) -> mx.array:
    return 0.5 * x * (1 + mx.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def _silu(x: mx.array) -> mx.array:
    # MLX's CPU sigmoid costs more than the exp it is built from: x / (1 + exp(-x)) is
    # ~25% faster (exp(-x) = inf for very negative x gives the right limit, -0).
    return x / (1 + mx.exp(-x))


@handles("gelu")
def _gelu(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    (x,) = args
    return _gelu_tanh(x) if attrs["approximate"] == "tanh" else _gelu_erf(x)


@handles("clamp")
def _clamp(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    (x,) = args
    # Python-float bounds would promote an integer x; the result keeps x's dtype.
    return mx.clip(x, attrs.get("min"), attrs.get("max")).astype(x.dtype)


@handles("cast")
def _cast(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    return args[0].astype(MX_DTYPES[attrs["dtype"]])


# -- reductions and normalisations -----------------------------------------------------
def reduction(fn: Callable[..., mx.array]) -> Handler:
    def handler(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
        (x,) = args
        return fn(x, axis=list(attrs["dims"]), keepdims=attrs["keepdim"])

    return handler


for _name, _fn in {"sum": mx.sum, "mean": mx.mean, "amax": mx.max, "amin": mx.min}.items():
    HANDLERS[_name] = reduction(_fn)


@handles("argmax")
def _argmax(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    (x,) = args
    dim, keepdim = attrs.get("dim"), attrs["keepdim"]
    if dim is None:
        flat = mx.argmax(x.reshape(-1))
        out = flat.reshape((1,) * x.ndim) if keepdim else flat
    else:
        out = mx.argmax(x, axis=dim, keepdims=keepdim)
    return out.astype(mx.int64)


@handles("softmax")
def _softmax(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    return mx.softmax(args[0], axis=attrs["dim"], precise=True)


@handles("log_softmax")
def _log_softmax(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    (x,) = args
    x32 = x.astype(mx.float32)
    return (x32 - mx.logsumexp(x32, axis=attrs["dim"], keepdims=True)).astype(x.dtype)


@handles("rms_norm")
def _rms_norm(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    x, weight = args
    # MLX's kernel (and its CPU fallback) normalizes in fp32 and rounds to the result
    # dtype before the weight multiply: HF's upcast chain, op for op.
    out = mx.fast.rms_norm(x, weight, attrs["eps"])
    dtype = attrs.get("dtype")
    return out if dtype is None else out.astype(MX_DTYPES[dtype])


@handles("layer_norm")
def _layer_norm(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    x, weight, bias = args
    return mx.fast.layer_norm(x, weight, bias, attrs["eps"])



_GLU_ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "silu": _silu,
    "gelu": _gelu_erf,
    "gelu_tanh": _gelu_tanh,
}


def _glu_with(act: Callable[[mx.array], mx.array]) -> Callable[[mx.array, mx.array], mx.array]:
    def glu(gate: mx.array, up: mx.array) -> mx.array:
        # torch computes a half-precision activation in fp32 and rounds once.
        return act(gate.astype(mx.float32)).astype(gate.dtype) * up

    return mx.compile(glu)


_GLU = {name: _glu_with(act) for name, act in _GLU_ACTIVATIONS.items()}


@handles("glu")
def _glu(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    if len(args) > 1 and args[1] is not None:
        gate, up = args
    else:  # a fused gate/up projection: gate first, up last, padding between
        width, fused = attrs["width"], args[0]
        # One split node (its parts are views), not a slice for each half.
        bounds = [width] if fused.shape[-1] == 2 * width else [width, fused.shape[-1] - width]
        parts = mx.split(fused, bounds, axis=-1)
        gate, up = parts[0], parts[-1]
    return _GLU[attrs["activation"]](gate, up)

# -- linear algebra and indexing -------------------------------------------------------
HANDLERS["matmul"] = on_operands(mx.matmul)


@handles("linear")
def _linear(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    x, weight, bias = args
    transposed = attrs.get("weight_t")  # [1, in, out], a view of the weight made at load
    if x.ndim and x.size == x.shape[-1] and mx.default_device().type == mx.DeviceType.cpu:
        # One row (decode): weight @ x runs as a BLAS gemv, ~30% faster on CPU than a
        # one-row gemm against the transposed weight.
        out = (weight @ x.reshape(-1)).reshape(*x.shape[:-1], weight.shape[0])
    elif gemv.available(x, weight):
        # One row on CUDA with MLX_PTE_GEMV=1: one graph node of a kernel built to read the
        # weight at the memory's bandwidth (runtime/mlx/gemv.py).
        out = gemv.gemv(x, weight)
    elif transposed is not None and x.ndim == 3 and x.shape[0] == 1:
        # One graph node: x @ weight.T costs a transpose and MLX's flatten and unflatten
        # around the matmul too, and a GPU step's host time grows with its nodes. The
        # kernel is the same (a gemv for one row, else a GEMM over the weight's rows).
        out = x @ transposed
    else:
        out = x @ weight.T
    return out if bias is None else out + bias


def _norm_linear(x: mx.array, residual: Optional[mx.array], norm_weight: mx.array,
                 kernel_weight: Optional[gemv.Weight], bias: Optional[mx.array], linear: Callable[[mx.array], mx.array],
                 attrs: dict[str, Any], ctx: RunContext) -> tuple[mx.array, mx.array]:
    """linear(rms_norm(h)) and h, where h is ``x + residual`` or x: one kernel over the
    linear's weight (``kernel_weight``, None where the kernel cannot read it) where
    ``gemv.norm_available`` says so, else the add, the norm and ``linear`` (the linear's
    handler on the normalized row) as they run apart."""
    if kernel_weight is not None and gemv.norm_available(x, norm_weight, kernel_weight, residual):
        out, total = gemv.norm_gemv(x, norm_weight, attrs["eps"], kernel_weight, residual=residual)
        return (out if bias is None else out + bias), total
    total = x if residual is None else x + residual
    return linear(_rms_norm([total, norm_weight], attrs, ctx)), total


@handles("rms_norm_linear")
def _rms_norm_linear(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    x, norm_weight, weight, bias = args
    linear = lambda row: _linear([row, weight, bias], attrs, ctx)  # noqa: E731
    return _norm_linear(x, None, norm_weight, weight, bias, linear, attrs, ctx)[0]


@handles("add_rms_norm_linear")
def _add_rms_norm_linear(args: Args, attrs: dict[str, Any], ctx: RunContext) -> tuple[mx.array, mx.array]:
    a, b, norm_weight, weight, bias = args
    linear = lambda row: _linear([row, weight, bias], attrs, ctx)  # noqa: E731
    return _norm_linear(a, b, norm_weight, weight, bias, linear, attrs, ctx)


@handles("rms_norm_quantized_linear")
def _rms_norm_quantized_linear(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    x, norm_weight, *parts = args  # weight, scales, biases, bias
    linear = lambda row: _quantized_linear([row, *parts], attrs, ctx)  # noqa: E731
    return _norm_linear(x, None, norm_weight, _packed4(parts, attrs), parts[3], linear, attrs, ctx)[0]


@handles("add_rms_norm_quantized_linear")
def _add_rms_norm_quantized_linear(args: Args, attrs: dict[str, Any], ctx: RunContext) -> tuple[mx.array, mx.array]:
    a, b, norm_weight, *parts = args
    linear = lambda row: _quantized_linear([row, *parts], attrs, ctx)  # noqa: E731
    return _norm_linear(a, b, norm_weight, _packed4(parts, attrs), parts[3], linear, attrs, ctx)


def _glu_linear(gate: mx.array, up: Optional[mx.array], kernel_weight: Optional[gemv.Weight],
                bias: Optional[mx.array], linear: Callable[[mx.array], mx.array], attrs: dict[str, Any],
                ctx: RunContext) -> mx.array:
    """linear(glu(gate, up)): one kernel over the linear's weight (``kernel_weight``, None
    where the kernel cannot read it) where ``gemv.glu_available`` says so, else the glu and
    ``linear`` (the linear's handler on the glu's row) as they run apart."""
    width = attrs.get("width") or gate.shape[-1]
    if kernel_weight is not None and gemv.glu_available(gate, up, width, attrs["activation"], kernel_weight):
        out = gemv.glu_gemv(gate, up, width, attrs["activation"], kernel_weight)
        return out if bias is None else out + bias
    return linear(_glu([gate, up], attrs, ctx))


@handles("glu_linear")
def _glu_dense_linear(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    gate, up, weight, bias = args
    linear = lambda row: _linear([row, weight, bias], attrs, ctx)  # noqa: E731
    return _glu_linear(gate, up, weight, bias, linear, attrs, ctx)


@handles("glu_quantized_linear")
def _glu_quantized_linear(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    gate, up, *parts = args  # weight, scales, biases, bias
    linear = lambda row: _quantized_linear([row, *parts], attrs, ctx)  # noqa: E731
    return _glu_linear(gate, up, _packed4(parts, attrs), parts[3], linear, attrs, ctx)


@handles("embedding")
def _embedding(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    weight, indices = args
    return mx.take(weight, indices, axis=0)


@handles("index_select")
def _index_select(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    x, index = args
    return mx.take(x, index, axis=attrs["dim"])


@handles("gather")
def _gather(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    x, index = args
    return mx.take_along_axis(x, index, axis=attrs["dim"])


# -- creation --------------------------------------------------------------------------
@handles("full")
def _full(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    dtype = MX_DTYPES[attrs["dtype"]]
    value = attrs["value"]
    # mx.full ignores dtype for a Python-float value of an integer or bool dtype.
    if not mx.issubdtype(dtype, mx.floating):
        value = bool(value) if dtype == mx.bool_ else int(value)
    return mx.full(attrs["shape"], mx.array(value, dtype=dtype))


@handles("arange")
def _arange(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    return mx.arange(attrs["start"], attrs["end"], attrs["step"], dtype=MX_DTYPES[attrs["dtype"]])


# -- host integers ---------------------------------------------------------------------
@handles("sym_size")
def _sym_size(args: Args, attrs: dict[str, Any], ctx: RunContext) -> int:
    return args[0].shape[attrs["dim"]]


def _scalar(fn: Callable[[int, int], int]) -> Handler:
    return lambda args, attrs, ctx: fn(attrs["a"], attrs["b"])


for _name, _fn in {
    "scalar_add": operator.add,
    "scalar_sub": operator.sub,
    "scalar_mul": operator.mul,
    "scalar_floordiv": operator.floordiv,
}.items():
    HANDLERS[_name] = _scalar(_fn)


# -- the KV cache ----------------------------------------------------------------------
@handles("update_and_attend")
def _update_and_attend(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    q, k, v, _positions, *sinks = args  # the cache takes positions from the declared step (host ints)
    if ctx.cache is None:
        raise MissingCacheError(
            "this program has attention layers: pass the KV cache to run(..., cache=...) "
            "after cache.declare_step(...) (or use Program.session())"
        )
    if sinks and sinks[0] is not None:
        return ctx.cache.attend(attrs["cache_id"], q, k, v, attrs["scale"], attrs["softcap"], sinks[0])
    return ctx.cache.attend(attrs["cache_id"], q, k, v, attrs["scale"], attrs["softcap"])


# -- quantized weights (ir.quantization) ------------------------------------------------
def _quant_kwargs(attrs: dict[str, Any]) -> dict[str, Any]:
    return {"group_size": attrs["group_size"], "bits": attrs["bits"], "mode": attrs["mode"]}


# MLX's CPU quantized matmul makes one pass over the packed weight per row of x: fastest
# for decode, ~10x slower than dequantizing once and using the BLAS matmul at 128 rows
# (crossover near 10 rows on a 1536 x 576 weight). Other devices always use the kernel.
CPU_DEQUANTIZE_ROWS = 16


def _packed4(parts: list, attrs: dict[str, Any]) -> Optional[gemv.Packed4]:
    """A quantized linear's weight as the GEMV kernel reads it: MLX's 4-bit affine packing
    only (None for every other mode, which the kernel does not take)."""
    weight, scales, biases = parts[:3]
    if attrs["mode"] != "affine" or attrs["bits"] != 4 or biases is None:
        return None
    return gemv.Packed4(weight, scales, biases, attrs["group_size"])


@handles("quantized_linear")
def _quantized_linear(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    x, weight, scales, biases, bias = args
    kwargs = _quant_kwargs(attrs)
    packed = _packed4(args[1:], attrs)
    if x.size >= CPU_DEQUANTIZE_ROWS * x.shape[-1] and mx.default_device().type == mx.DeviceType.cpu:
        out = x @ mx.dequantize(weight, scales, biases, dtype=x.dtype, **kwargs).T
    elif packed is not None and gemv.available(x, packed):
        out = gemv.gemv(x, packed)  # as for linear: one row on CUDA with MLX_PTE_GEMV=1
    else:
        out = mx.quantized_matmul(x, weight, scales, biases, transpose=True, **kwargs)
    return out if bias is None else out + bias


@handles("quantized_embedding")
def _quantized_embedding(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    # Only the selected rows are dequantized: a token's row is its packed row.
    weight, scales, biases, indices = args
    rows = [None if part is None else mx.take(part, indices, axis=0) for part in (weight, scales, biases)]
    return mx.dequantize(*rows, dtype=MX_DTYPES[attrs["dtype"]], **_quant_kwargs(attrs))


HANDLERS["all_sum"] = all_sum  # interpreter.groups: the process group it names

# The op families kept in modules of their own register themselves on import; they build
# on ``handles`` above.
from . import layout_handlers, moe_handlers, rope_handlers, upstream_handlers  # noqa: E402,F401

# One catalog: an op without a handler (or a handler without an op) is a bug here.
_missing = sorted(set(CATALOG) - set(HANDLERS))
_extra = sorted(set(HANDLERS) - set(CATALOG))
if _missing or _extra:
    raise ImportError(f"catalog and handlers disagree: no handler for {_missing}, no catalog entry for {_extra}")
