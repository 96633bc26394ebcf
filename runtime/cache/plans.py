"""Run plans for sequence layouts: where a step's K/V go and which rows it reads.

A layout is a stateless per-layer planner. Flat keeps every position at the row of the
same index. Ring(window w, max_write m) keeps ``R = w + m - 1`` slots, position q at slot
``q mod R``: the extra ``m - 1`` slots let a step of up to m tokens land without
overwriting rows that the same step's earlier queries still read.

Invariants of a ``RunPlan``: write lens sum to ``count``; read runs, concatenated in
order, hold logical positions ``[read_base, position + count)`` oldest first.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Union

from .config import CacheConfig, CacheGeometry, LayerPolicy


@dataclass(frozen=True)
class Run:
    """Physical rows ``[start, start + length)`` of one layer's pool."""

    start: int
    length: int


class MaskKind(Enum):
    """What a byte layer must mask, lower-right aligned like MLX's ``"causal"``.

    NONE: a decode token; its read span is exactly what it may see.
    CAUSAL: query i of T over S keys sees keys ``j <= i + S - T``.
    BAND: CAUSAL and, for a ring of window w, keys ``j >= i + S - T - w + 1``.
    """

    NONE = "none"
    CAUSAL = "causal"
    BAND = "band"


@dataclass(frozen=True)
class RunPlan:
    """One sequence's step on one layout."""

    position: int
    count: int
    write: tuple[Run, ...]
    read: tuple[Run, ...]
    read_base: int
    window: int  # 0 = flat

    @property
    def read_len(self) -> int:
        return self.position + self.count - self.read_base

    @property
    def mask(self) -> MaskKind:
        if self.count == 1:
            return MaskKind.NONE
        if self.window and self.window < self.read_len:
            return MaskKind.BAND
        return MaskKind.CAUSAL


@dataclass(frozen=True)
class FlatLayout:
    """All history, physical row = logical position."""

    window: int = 0

    @property
    def max_write(self) -> None:
        return None

    def plan(self, position: int, count: int) -> RunPlan:
        end = position + count
        return RunPlan(position, count, (Run(position, count),), (Run(0, end),), 0, 0)

    def retained_from(self, written: int) -> int:
        return 0


@dataclass(frozen=True)
class RingLayout:
    """The last ``window`` positions in ``window + max_write - 1`` slots."""

    window: int
    max_write: int

    @property
    def slots(self) -> int:
        return self.window + self.max_write - 1

    def split(self, start: int, length: int) -> tuple[Run, ...]:
        """Logical ``[start, start + length)`` as 1-2 physical runs, oldest first."""
        phys = start % self.slots
        first = min(length, self.slots - phys)
        if first == length:
            return (Run(phys, length),)
        return (Run(phys, first), Run(0, length - first))

    def plan(self, position: int, count: int) -> RunPlan:
        # The read span is the union of the step's per-query windows.
        read_base = max(0, position - self.window + 1)
        end = position + count
        return RunPlan(
            position,
            count,
            self.split(position, count),
            self.split(read_base, end - read_base),
            read_base,
            self.window,
        )

    def retained_from(self, written: int) -> int:
        """The oldest position a sequence may resume at after writing ``[0, written)``.

        The slots hold positions ``[written - R, written)``; resuming at p reads
        ``[p - w + 1, p)``, all resident iff ``p >= written - max_write``.
        """
        return max(0, written - self.max_write)


Layout = Union[FlatLayout, RingLayout]


def make_layout(policy: LayerPolicy, max_write: int | None) -> Layout:
    if not policy.is_ring:
        return FlatLayout()
    return RingLayout(policy.window, max_write if max_write is not None else policy.window)


@dataclass(frozen=True)
class PolicyTable:
    """Distinct layouts of a geometry (deduplicated by kind and window) and each layer's.

    Steps are planned once per distinct layout, never per layer.
    """

    layouts: tuple[Layout, ...]
    layer_layout: tuple[int, ...]

    @classmethod
    def build(cls, geometry: CacheGeometry, config: CacheConfig) -> "PolicyTable":
        layouts: list[Layout] = []
        index: dict[Layout, int] = {}
        layer_layout = []
        for policy in geometry.policies:
            layout = make_layout(policy, config.max_write)
            if layout not in index:
                index[layout] = len(layouts)
                layouts.append(layout)
            layer_layout.append(index[layout])
        return cls(tuple(layouts), tuple(layer_layout))

    @property
    def rings(self) -> tuple[RingLayout, ...]:
        return tuple(l for l in self.layouts if isinstance(l, RingLayout))

    @property
    def smallest_max_write(self) -> int | None:
        """The most tokens one step may write per sequence, or None when unbounded."""
        rings = self.rings
        return min(r.max_write for r in rings) if rings else None

    def floor(self, written: int) -> int:
        """The oldest position a sequence that wrote ``[0, written)`` may resume at."""
        return max(layout.retained_from(written) for layout in self.layouts)

    def plan(self, position: int, count: int) -> tuple[RunPlan, ...]:
        """One plan per distinct layout."""
        return tuple([layout.plan(position, count) for layout in self.layouts])
