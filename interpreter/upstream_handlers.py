"""Handlers of the ops only imported upstream programs use (``ir.catalog.UPSTREAM_ONLY``):
upstream's exporter lowers these and mlx-pte's own never does.
"""
from __future__ import annotations

from typing import Any, Callable

from mlx_pte.runtime.mlx.bootstrap import mx

from .handlers import HANDLERS, MX_DTYPES, Args, Handler, RunContext, on_operands, reduction, handles

_UPSTREAM_ELEMENTWISE = {
    "floor": mx.floor, "ceil": mx.ceil, "trunc": mx.trunc, "tan": mx.tan, "asin": mx.arcsin,
    "acos": mx.arccos, "atan": mx.arctan, "sinh": mx.sinh, "cosh": mx.cosh, "asinh": mx.arcsinh,
    "acosh": mx.arccosh, "atanh": mx.arctanh, "log2": mx.log2, "log10": mx.log10, "log1p": mx.log1p,
    "expm1": mx.expm1, "sign": mx.sign, "bitwise_not": mx.bitwise_invert,
    "atan2": mx.arctan2, "logaddexp": mx.logaddexp, "floor_divide": mx.floor_divide,
    "remainder": mx.remainder, "bitwise_and": mx.bitwise_and, "bitwise_or": mx.bitwise_or,
    "bitwise_xor": mx.bitwise_xor,
}  # fmt: skip
for _name, _fn in _UPSTREAM_ELEMENTWISE.items():
    HANDLERS[_name] = on_operands(_fn)
for _name, _fn in {"prod": mx.prod, "logsumexp": mx.logsumexp, "any": mx.any, "all": mx.all}.items():
    HANDLERS[_name] = reduction(_fn)


def _spread(fn: Callable[..., mx.array]) -> Handler:
    def handler(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
        (x,) = args
        return fn(x, axis=list(attrs["dims"]), keepdims=attrs["keepdim"], ddof=attrs["ddof"])

    return handler


HANDLERS["var"], HANDLERS["std"] = _spread(mx.var), _spread(mx.std)


@handles("round")
def _round(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    return mx.round(args[0], attrs["decimals"])


def _triangle(fn: Callable[..., mx.array]) -> Handler:
    return lambda args, attrs, ctx: fn(args[0], attrs["k"])


HANDLERS["tril"], HANDLERS["triu"] = _triangle(mx.tril), _triangle(mx.triu)


@handles("cumsum")
def _cumsum(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    return mx.cumsum(args[0], axis=attrs["dim"], reverse=attrs["reverse"], inclusive=attrs["inclusive"])


@handles("roll")
def _roll(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    return mx.roll(args[0], list(attrs["shifts"]), axis=list(attrs["dims"]))


@handles("full_like")
def _full_like(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    (x,) = args
    dtype = x.dtype if attrs.get("dtype") is None else MX_DTYPES[attrs["dtype"]]
    return mx.full(x.shape, attrs["value"], dtype=dtype)


HANDLERS["sort"] = lambda args, attrs, ctx: mx.sort(args[0], axis=attrs["dim"])
HANDLERS["argsort"] = lambda args, attrs, ctx: mx.argsort(args[0], axis=attrs["dim"])
HANDLERS["partition"] = lambda args, attrs, ctx: mx.partition(args[0], attrs["kth"], axis=attrs["dim"])
HANDLERS["argpartition"] = lambda args, attrs, ctx: mx.argpartition(args[0], attrs["kth"], axis=attrs["dim"])


@handles("flip")
def _flip(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    (x,) = args
    axes = {d % x.ndim for d in attrs["dims"]}
    return x[tuple(slice(None, None, -1) if axis in axes else slice(None) for axis in range(x.ndim))]


@handles("repeat_interleave")
def _repeat_interleave(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    return mx.repeat(args[0], attrs["repeats"], axis=attrs["dim"])


@handles("pad")
def _pad(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    (x,) = args
    widths = attrs["widths"]
    pairs = [(widths[i], widths[i + 1]) for i in range(0, len(widths), 2)]
    return mx.pad(x, pairs, mode=attrs["mode"], constant_values=attrs["value"])


@handles("sdpa")
def _sdpa(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    q, k, v, mask = args
    if attrs["causal"]:
        mask = "causal"
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=attrs["scale"], mask=mask)


@handles("scatter_add")
def _scatter_add(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    x, index, updates = args
    dim = attrs["dim"] % x.ndim
    # Every element's full coordinates: its own along each axis, index's along dim.
    coords = [mx.arange(n).reshape([-1 if i == axis else 1 for i in range(index.ndim)])
              for axis, n in enumerate(index.shape)]  # fmt: skip
    coords[dim] = index
    return x.at[tuple(coords)].add(updates)
