"""Layout plans: where a step writes, what it reads, which mask the byte layer applies."""
from __future__ import annotations

import pytest

from mlx_pte.runtime.cache import (
    CacheRefused,
    FlatLayout,
    MaskKind,
    PolicyTable,
    RingLayout,
    Run,
    SingleCache,
    Step,
)
from mlx_pte.runtime.cache.config import CacheConfig

from .helpers import FLAT, build, geometry, ring, run
from .shadow import visible


def only_plan(cache: SingleCache, layer: int = 0):
    ((_, plan),) = cache.step_plan.runs_for_layer(layer)
    return plan


def test_flat_plan_appends_and_reads_all_history():
    cache = build(SingleCache, 32, FLAT)
    cache.declare_step(Step.run(0, 4))
    plan = only_plan(cache)
    assert (plan.write, plan.read, plan.read_base) == ((Run(0, 4),), (Run(0, 4),), 0)
    cache.finish_step()
    cache.declare_step(Step.run(4, 1))
    plan = only_plan(cache)
    assert plan.write == (Run(4, 1),)
    assert plan.read == (Run(0, 5),) and plan.read_len == 5


def test_ring_plan_wraps_and_evicts():
    # w = 4 and max_write unset (m = 4): 7 slots.
    cache = build(SingleCache, 32, ring(4))
    assert cache.policies.layouts[0].slots == 7
    cache.declare_step(Step.run(0, 4))
    plan = only_plan(cache)
    assert (plan.write, plan.read, plan.read_base) == ((Run(0, 4),), (Run(0, 4),), 0)
    cache.finish_step()
    run(cache, 0, 4, 3)
    cache.declare_step(Step.run(7, 1))
    plan = only_plan(cache)
    assert plan.write == (Run(0, 1),)  # 7 mod 7
    assert plan.read == (Run(4, 3), Run(0, 1)) and plan.read_base == 4


def test_a_ring_step_longer_than_max_write_is_refused():
    cache = build(SingleCache, 32, ring(4))
    with pytest.raises(CacheRefused, match="max_write"):
        cache.declare_step(Step.run(0, 5))
    assert not cache.is_declared


def test_ring_split_covers_the_span_in_logical_order():
    layout = RingLayout(window=3, max_write=2)  # 4 slots
    for start in range(0, 12):
        for length in range(1, layout.slots + 1):
            runs = layout.split(start, length)
            rows = [r.start + k for r in runs for k in range(r.length)]
            assert rows == [(start + k) % 4 for k in range(length)]
            assert 1 <= len(runs) <= 2


def test_layouts_are_deduplicated_by_kind_and_window():
    geo = geometry(FLAT, ring(4), FLAT, ring(4), ring(2))
    table = PolicyTable.build(geo, CacheConfig(64))
    assert table.layouts == (FlatLayout(), RingLayout(4, 4), RingLayout(2, 2))
    assert table.layer_layout == (0, 1, 0, 1, 2)
    assert table.smallest_max_write == 2
    # max_write applies to every ring.
    table = PolicyTable.build(geo, CacheConfig(64, max_write=3))
    assert table.layouts[1:] == (RingLayout(4, 3), RingLayout(2, 3))


@pytest.mark.parametrize(
    "layout, history, step, kind",
    [
        (FlatLayout(), 0, 1, MaskKind.NONE),  # decode is unmasked
        (FlatLayout(), 0, 4, MaskKind.CAUSAL),  # a fresh prefill is causal
        (FlatLayout(), 4, 3, MaskKind.CAUSAL),  # a continuation: lower-right causal
        (RingLayout(3, 3), 9, 1, MaskKind.NONE),  # windowed decode: the span is the window
        (RingLayout(2, 2), 0, 2, MaskKind.CAUSAL),  # window = span: still causal
        (RingLayout(2, 4), 0, 4, MaskKind.BAND),  # each query its own window
        (RingLayout(2, 3), 4, 3, MaskKind.BAND),  # windowed continuation: band both ends
        (RingLayout(4, 4), 0, 4, MaskKind.CAUSAL),  # window equal to history stays fused
        (RingLayout(4, 4), 4, 1, MaskKind.NONE),
        (RingLayout(4, 4), 4, 2, MaskKind.BAND),
        (RingLayout(64, 64), 0, 8, MaskKind.CAUSAL),  # window wider than history
        (RingLayout(64, 64), 8, 1, MaskKind.NONE),
    ],
)
def test_mask_kind_gives_each_query_exactly_its_window(layout, history, step, kind):
    plan = layout.plan(history, step)
    assert plan.mask is kind
    # Brute force: query at position q sees [q - w + 1, q] (all of [0, q] when flat).
    for i in range(step):
        q = history + i
        lo = max(0, q - layout.window + 1) if layout.window else 0
        seen = [plan.read_base + j for j in range(plan.read_len) if visible(plan, i, j)]
        assert seen == list(range(lo, q + 1))


def test_continuation_band_is_lower_right_aligned():
    plan = FlatLayout().plan(4, 3)
    rows = [[visible(plan, i, j) for j in range(plan.read_len)] for i in range(3)]
    # ones(3, 7).tril(4)
    assert rows == [[j <= i + 4 for j in range(7)] for i in range(3)]


def test_ring_read_span_never_exceeds_the_slots():
    for w in range(1, 6):
        for m in range(1, 6):
            layout = RingLayout(w, m)
            for position in range(0, 20):
                for count in range(1, m + 1):
                    plan = layout.plan(position, count)
                    assert plan.read_len <= layout.slots
                    assert sum(r.length for r in plan.write) == count
                    assert sum(r.length for r in plan.read) == plan.read_len
