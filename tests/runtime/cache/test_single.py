"""``single``: one sequence, one length for every layer; capacity bounds positions."""
from __future__ import annotations

import pytest

import warnings

from mlx_pte.runtime.cache import (
    CacheControl,
    CacheRefused,
    SingleCache,
    Step,
    StepStateError,
)

from .helpers import FLAT, build, ring, run, snapshot
from .shadow import ShadowSingle


def test_mixed_flat_and_ring_layers_share_one_length():
    cache = build(SingleCache, 100, FLAT, ring(4))
    cache.declare_step(Step.run(0, 3))
    flat, windowed = (cache.step_plan.runs_for_layer(layer) for layer in (0, 1))
    assert flat[0][1].write == windowed[0][1].write  # both write position 0..2
    cache.finish_step()
    assert cache.pos(0) == 3
    assert cache.can_extend(0, 97)
    assert not cache.can_extend(0, 98)


def test_can_extend_is_bounded_by_capacity():
    cache = build(SingleCache, 2, FLAT)
    assert cache.can_extend(0, 2)
    run(cache, 0, 0, 2)
    verdict = cache.can_extend(0, 1)
    assert not verdict and "2 of 2" in verdict.reason
    with pytest.raises(CacheRefused, match="capacity is 2"):
        cache.declare_step(Step.run(2, 1))


def test_flat_rewinds_freely_to_zero():
    cache = build(SingleCache, 8, FLAT)
    run(cache, 0, 0, 5)
    cache.rewind(0, 0)
    assert cache.pos(0) == 0
    with pytest.raises(CacheRefused, match="cannot grow"):
        cache.rewind(0, 1)
    run(cache, 0, 0, 3)
    cache.clear()
    assert cache.pos(0) == 0 and cache.can_extend(0, 8)
    assert cache.rewind_floor(0) == 0


def test_rewind_is_bounded_by_the_ring():
    # m defaults to the window (4): after writing 10 the ring serves resumes from 6.
    cache = build(SingleCache, 64, FLAT, ring(4))
    for p in range(0, 10, 2):
        run(cache, 0, p, 2)
    assert cache.rewind_floor(0) == 6
    before = snapshot(cache)
    for bad in (5, 11):
        assert not cache.can_rewind(0, bad)
        with pytest.raises(CacheRefused):
            cache.rewind(0, bad)
        assert snapshot(cache) == before
    cache.rewind(0, 6)
    assert cache.pos(0) == 6


@pytest.mark.parametrize(
    "max_write, floor",
    [(1, 20), (5, 16), (3, 18)],  # w = 4, written 21: floor = written - max_write
)
def test_ring_floor_is_the_high_water_mark_minus_max_write(max_write, floor):
    cache = build(SingleCache, 64, ring(4), max_write=max_write)
    p = 0
    while p < 21:
        n = min(max_write, 21 - p)
        run(cache, 0, p, n)
        p += n
    assert cache.rewind_floor(0) == floor
    assert cache.can_rewind(0, floor) and not cache.can_rewind(0, floor - 1)


def test_rewind_never_lowers_the_floor():
    # Rewinding and rewriting keeps the high-water mark, so a second rewind cannot reach
    # past what the ring still holds.
    cache = build(SingleCache, 64, ring(4), max_write=1)
    for p in range(21):
        run(cache, 0, p, 1)
    cache.rewind(0, 20)
    run(cache, 0, 20, 1)
    cache.rewind(0, 20)
    assert cache.rewind_floor(0) == 20
    assert not cache.can_rewind(0, 19)


def test_the_one_face_with_one_implicit_sequence():
    cache = build(SingleCache, 8, FLAT)
    assert isinstance(cache, CacheControl) and cache.kind == "single"
    assert cache.max_seqs() == 1 and cache.live_seqs() == (0,)
    run(cache, 0, 0, 3)  # sequence 0 needs no seq_new
    with pytest.raises(CacheRefused, match="holds 3 positions"):
        cache.seq_new()
    verdict = cache.can_clone(0, 2)
    assert not verdict and "cannot fork" in verdict.reason
    with pytest.raises(CacheRefused, match="cannot fork"):
        cache.seq_clone(0, 2)
    for bad in (1, -1, None):
        assert not cache.can_extend(bad, 1) and not cache.can_rewind(bad, 0)
        with pytest.raises(CacheRefused, match="not live"):
            cache.seq_rm(bad)
    assert cache.pos(0) == 3
    cache.seq_rm(0)  # empties it; it still exists
    assert cache.pos(0) == 0 and cache.live_seqs() == (0,)
    assert cache.seq_new() == 0
    run(cache, 0, 0, 2)
    assert cache.usage().logical_positions == 2


def test_the_old_one_argument_forms_still_work_and_warn():
    cache = build(SingleCache, 8, FLAT)
    run(cache, 0, 0, 5)
    with pytest.warns(DeprecationWarning, match=r"rewind\(0, value\)"):
        cache.rewind(3)
    with pytest.warns(DeprecationWarning, match="can_rewind"):
        assert cache.can_rewind(2) and not cache.can_rewind(4)
    with pytest.warns(DeprecationWarning, match="can_extend"):
        assert cache.can_extend(5) and not cache.can_extend(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults of sequence 0 are not deprecated
        assert cache.pos() == 3 and cache.rewind_floor() == 0
        assert cache.can_extend() and cache.can_extend(n=5) and not cache.can_extend(n=6)


def test_admission_charges_the_whole_history():
    cache = build(SingleCache, 40, FLAT)
    assert cache.sample_share(10, 1) == 40
    assert cache.footprint(10, 1, 25) == 25


def test_the_single_layout_holds_only_sequence_zero():
    cache = build(SingleCache, 8, FLAT)
    with pytest.raises(CacheRefused, match="one sequence"):
        cache.declare_step(Step.run(0, 1, seq_id=1))


def test_finish_commits_and_abort_leaves_the_length():
    cache = build(SingleCache, 16, FLAT, ring(2), max_write=2)
    run(cache, 0, 0, 2)
    cache.declare_step(Step.run(2, 2))
    cache.abort_step()
    assert cache.pos(0) == 2 and not cache.is_declared
    # The ring slots of 2..3 were (possibly) overwritten: the floor rose with them.
    assert cache.rewind_floor(0) == 2
    for call in (cache.finish_step, cache.abort_step):
        with pytest.raises(StepStateError, match="declare_step"):
            call()


def test_usage_counts_logical_positions_and_ring_slots():
    cache = build(SingleCache, 64, FLAT, ring(4), max_write=2)  # ring: 5 slots
    for p in range(0, 12, 2):
        run(cache, 0, p, 2)
    usage = cache.usage()
    assert (usage.logical_positions, usage.physical_slots, usage.capacity) == (12, 12 + 5, 64)


def test_every_verb_drops_the_declared_step():
    cache = build(SingleCache, 16, FLAT)
    run(cache, 0, 0, 4)
    for verb in (lambda: cache.rewind(0, 2), cache.clear, lambda: cache.seq_rm(0)):
        cache.declare_step(Step.run(cache.pos(0), 1))
        verb()
        assert not cache.is_declared
        with pytest.raises(StepStateError):
            cache.step_plan


def test_shadow_reads_continue_across_rewinds():
    cache = build(ShadowSingle, 64, FLAT, ring(3), max_write=2)
    values = {}
    for p in range(0, 10, 2):
        cache.declare_step(Step.run(p, 2))
        for layer in (0, 1):
            cache.write_and_read(layer, [("v", p), ("v", p + 1)])
        values.update({p: ("v", p), p + 1: ("v", p + 1)})
        cache.finish_step()
    cache.rewind(0, 8)  # floor = 10 - 2
    cache.declare_step(Step.run(8, 1))
    seen = {layer: cache.write_and_read(layer, ["new"]) for layer in (0, 1)}
    assert seen[0] == [[(p, values[p]) for p in range(8)] + [(8, "new")]]
    assert seen[1] == [[(6, values[6]), (7, values[7]), (8, "new")]]
    assert cache.stale_reads == 0
