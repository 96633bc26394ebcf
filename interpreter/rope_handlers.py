"""Handlers of the rotary ops: ``rope`` (MLX's fused kernel on a GPU, HF's angle table
elsewhere) and ``rope_half`` (the rotation of a cos/sin table the graph computes itself).
"""
from __future__ import annotations

from functools import lru_cache, partial
from typing import Any, Callable, Optional

import numpy as np

from mlx_pte.runtime.mlx.bootstrap import mx

from .handlers import Args, RunContext, handles


def _rope_half(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return x * cos + mx.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


# Compiled, the elementwise math fuses into few kernels (MLX retraces once per shape).
_rope_half_compiled = mx.compile(_rope_half)


@handles("rope_half")
def _rope_half_handler(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    return _rope_half_compiled(*args)


def rope_from_table(x: mx.array, positions: mx.array, inv_freq: mx.array, seq_axis: int = 2,
                    table_scale: float = 1.0) -> mx.array:
    """``rope`` as HF computes it: an fp32 angle table, cos/sin (times ``table_scale``)
    rounded to x's dtype."""
    angles = positions.reshape(-1, 1).astype(mx.float32) * inv_freq
    table = mx.concatenate([angles, angles], axis=-1)
    if seq_axis == 1:  # [T, D] broadcast over the heads axis that follows T
        table = mx.expand_dims(table, 1)
    cos, sin = mx.cos(table), mx.sin(table)
    if table_scale != 1.0:
        cos, sin = cos * table_scale, sin * table_scale
    return _rope_half(x, cos.astype(x.dtype), sin.astype(x.dtype))


# ``rope_fast`` puts the tokens on the batch axis: [1, H, T, D] or [1, T, H, D] -> [T, H, 1, D].
_TOKENS_FIRST = {2: (2, 1, 0, 3), 1: (1, 2, 0, 3)}
_TOKENS_BACK = {2: (2, 1, 0, 3), 1: (2, 0, 1, 3)}


def rope_fast(x: mx.array, positions: mx.array, inv_freq: mx.array, seq_axis: int = 2,
              base: Optional[float] = None, freqs: Optional[mx.array] = None,
              table_scale: float = 1.0) -> mx.array:
    """``rope`` on MLX's fused kernel, for any positions: it takes one offset per batch
    item, so each token goes on the batch axis (a transposed view, no copy). The kernel
    rotates in fp32 and rounds once (the table path rounds cos/sin first). A
    ``table_scale`` other than 1 scales the rotated result (rotation is linear in its
    table): x is rotated in fp32, scaled and rounded once, since scaling a rounded result
    rounds twice (measured at up to 2x HF's own bf16 error; this way it is below it).

    ``base`` (when ``inv_freq`` is the base form ``base ** (-2i / D)``) or ``freqs``
    (``1 / inv_freq``) come from ``rope_form``, computed once at load; without either
    the reciprocal is taken here, on every call.
    """
    # One token (decode) on axis 2 is already on the batch axis: no transposes.
    moved = x.shape[seq_axis] != 1 or seq_axis != 2
    tokens = mx.transpose(x, _TOKENS_FIRST[seq_axis]) if moved else x
    if table_scale != 1.0:
        tokens = tokens.astype(mx.float32)
    if base is None and freqs is None:
        freqs = mx.reciprocal(inv_freq)
    offset = positions if positions.ndim == 1 else positions.reshape(-1)  # a reshape is a node
    out = mx.fast.rope(tokens, x.shape[-1], traditional=False, base=base, scale=1.0,
                       offset=offset, freqs=freqs)  # fmt: skip
    if table_scale != 1.0:
        out = (out * table_scale).astype(x.dtype)
    return mx.transpose(out, _TOKENS_BACK[seq_axis]) if moved else out


# How close (relative) ``inv_freq`` must be to the base form for the kernel to compute
# it: a few fp32 ulps, the spread between HF's fp32 table and the kernel's own exp2.
_BASE_FORM_RTOL = 1e-6


def rope_form(inv_freq: mx.array) -> dict[str, Any]:
    """The ``rope_fast`` keywords for a constant ``inv_freq``, computed once at load.

    ``{"base": b}`` when ``inv_freq[i] == b ** (-2i / D)`` (plain RoPE: the kernel derives
    the frequencies itself, no operand), otherwise ``{"freqs": 1 / inv_freq}`` evaluated
    (scaled RoPE such as llama3's, whose low frequencies are stretched).
    """
    values = np.array(inv_freq.astype(mx.float32), dtype=np.float64).reshape(-1)
    half = values.size
    if half > 1 and values[0] == 1.0 and 0.0 < values[-1] < 1.0:
        # From the last (smallest) entry: its exponent is the largest, so an ulp of error
        # there moves the estimated base least.
        base = float(values[-1] ** (-half / (half - 1)))
        expected = base ** (-np.arange(half) / half)
        if np.allclose(values, expected, rtol=_BASE_FORM_RTOL, atol=0.0):
            return {"base": base}
    # The kernel takes 1 / freqs again in fp32: a reciprocal rounded once (from float64)
    # brings that back closest to the table.
    return {"freqs": mx.array((1.0 / values).astype(np.float32))}


@lru_cache(maxsize=None)
def _rope_from_table_compiled(seq_axis: int, table_scale: float) -> Callable[..., mx.array]:
    return mx.compile(partial(rope_from_table, seq_axis=seq_axis, table_scale=table_scale))


@handles("rope")
def _rope(args: Args, attrs: dict[str, Any], ctx: RunContext) -> mx.array:
    table_scale = float(attrs.get("table_scale", 1.0))
    # On the CPU MLX has no rope kernel (mx.fast.rope falls back to separate ops), so
    # the compiled table is faster there.
    if mx.default_device().type == mx.DeviceType.gpu:
        return rope_fast(*args, attrs["seq_axis"], attrs.get("base"), attrs.get("freqs"), table_scale)
    return _rope_from_table_compiled(attrs["seq_axis"], table_scale)(*args)
