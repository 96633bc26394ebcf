"""Attention masks built on device, and the per-step memo that shares them across layers.

Masks are lower-right aligned like MLX's ``"causal"``: with T queries over S keys,
query i owns key ``i + S - T``. Every mask is a bool array, True = attend, built from a
few ``arange`` compares (never a host loop), once per step per layout.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Optional, TypeVar, Union

from mlx_pte.runtime.mlx.bootstrap import mx

from mlx_pte.runtime.cache import MaskKind, RunPlan

# What mx.fast.scaled_dot_product_attention accepts as a mask.
Mask = Union[None, str, mx.array]
CAUSAL = "causal"

T = TypeVar("T")


def lower_right_mask(queries: int, keys: int, window: int = 0) -> mx.array:
    """bool [1, 1, queries, keys]: query i sees key j iff ``j <= i + keys - queries``
    and, when ``window > 0``, ``j >= i + keys - queries - window + 1``."""
    offset = mx.arange(keys, dtype=mx.int32)[None, :] - mx.arange(queries, dtype=mx.int32)[:, None]
    newest = keys - queries
    mask = offset <= newest
    if window:
        mask = mx.logical_and(mask, offset >= newest - window + 1)
    return mask[None, None]


def run_mask(run: RunPlan) -> Mask:
    """The SDPA mask of one sequence span read in logical order.

    A decode token reads exactly what it may see (no mask); a span whose window covers
    what it reads is the fused lower-right causal; a narrower ring needs the band.
    """
    if run.mask is MaskKind.NONE:
        return None
    if run.mask is MaskKind.CAUSAL:
        return CAUSAL
    return lower_right_mask(run.count, run.read_len, run.window)


def visible(
    key_pos: mx.array, query_pos: mx.array, window: int
) -> mx.array:
    """bool: a key at ``key_pos`` is visible to a query at ``query_pos``.

    Negative key positions are empty slots or cells. Both arrays broadcast against each
    other; positions of the same sequence only (callers mask other sequences).
    """
    seen = mx.logical_and(key_pos >= 0, key_pos <= query_pos)
    if window:
        seen = mx.logical_and(seen, key_pos > query_pos - window)
    return seen


class StepMemo:
    """Arrays derived from one declared step, built on first use, shared by every layer.

    Keyed on the plan object: a new declaration (a new plan) drops everything, so a
    mask never outlives its step and is built once per step per key (a layout index).
    """

    def __init__(self) -> None:
        self._plan: Optional[Any] = None
        self._items: dict[Hashable, Any] = {}

    def get(self, plan: Any, key: Hashable, build: Callable[[], T]) -> T:
        if plan is not self._plan:
            self._plan = plan
            self._items = {}
        if key not in self._items:
            self._items[key] = build()
        return self._items[key]

    def clear(self) -> None:
        self._plan = None
        self._items = {}
