"""Pins for the upstream bugs that must not come back (neutral_cache.md §12.4, §13)."""
from __future__ import annotations

import numpy as np
import pytest

from mlx_pte.runtime.cache import (
    AttendError,
    BatchedSequenceCache,
    CacheRefused,
    CellCache,
    InvalidStep,
    SingleCache,
    Step,
    StepStateError,
)

from .helpers import FLAT, build, ring, run, snapshot, step
from .shadow import ShadowBatched, ShadowCells, ShadowSingle
from .toy import forward, oracle, toy_cache

TOKENS = [int(t) for t in np.random.default_rng(2).integers(0, 64, size=32)]


def new_seq(cache) -> int:
    return 0 if isinstance(cache, SingleCache) else cache.seq_new()


def pos(cache, seq_id: int) -> int:
    return cache.pos() if isinstance(cache, SingleCache) else cache.pos(seq_id)


@pytest.mark.parametrize("cls", [SingleCache, CellCache, BatchedSequenceCache])
def test_a_rejected_declaration_leaves_the_last_one_standing(cls):
    cache = build(cls, 8, FLAT, ring(2))
    a = new_seq(cache)
    run(cache, a, 0, 2)
    standing = cache.declare_step(Step.run(2, 1, a))
    before = snapshot(cache)
    for bad in (Step.run(2, 1, 5), Step.run(1, 1, a), Step.run(2, 7, a)):
        with pytest.raises(CacheRefused):
            cache.declare_step(bad)
        assert cache.step_plan is standing and snapshot(cache) == before
    with pytest.raises(InvalidStep):
        cache.declare_step(step([], []))
    assert cache.step_plan is standing
    cache.finish_step()
    assert pos(cache, a) == 3


def test_a_partial_fork_of_a_wrapped_ring():
    cache = toy_cache(max_write=1)  # 4 slots
    a = cache.seq_new()
    forward(cache, a, TOKENS[:10], 0, 1)
    with pytest.raises(CacheRefused):
        cache.seq_clone(a, 6)
    fork = cache.seq_clone(a, 9)
    branch = TOKENS[:9] + [TOKENS[12]]
    (got,) = forward(cache, fork, branch[9:], 9, 1)
    assert got == pytest.approx(oracle(branch)[9], abs=1e-12)
    assert cache.stale_reads == 0


def test_a_fork_of_a_fork_keeps_the_donors_floor():
    cache = toy_cache(max_write=1)
    a = cache.seq_new()
    forward(cache, a, TOKENS[:10], 0, 1)
    b = cache.seq_clone(a, 9)
    assert cache.rewind_floor(b) == 9
    with pytest.raises(CacheRefused, match="from 9 on"):
        cache.seq_clone(b, 8)
    with pytest.raises(CacheRefused):
        cache.rewind(b, 8)


def test_the_retained_boundary_and_an_older_snapshot():
    cache = toy_cache(max_write=3)  # 6 slots
    a = cache.seq_new()
    forward(cache, a, TOKENS[:17], 0, 3)
    older = cache.seq_clone(a, 17)
    forward(cache, a, TOKENS[17:21], 17, 3)
    assert cache.pos(cache.seq_clone(a, 18)) == 18
    with pytest.raises(CacheRefused):
        cache.seq_clone(a, 17)
    fork = cache.seq_clone(older, 17)
    branch = TOKENS[:17] + TOKENS[5:8]
    got = forward(cache, fork, branch[17:], 17, 3)
    np.testing.assert_allclose(got, oracle(branch)[17:], rtol=0, atol=1e-12)
    assert cache.stale_reads == 0


@pytest.mark.parametrize("cls", [ShadowSingle, ShadowCells, ShadowBatched])
def test_ill_formed_steps_are_refused(cls):
    cache = build(cls, 16, FLAT, ring(3), max_write=2)
    a = new_seq(cache)
    with pytest.raises(StepStateError):
        cache.write_and_read(0, ["x"])
    with pytest.raises(StepStateError):
        cache.finish_step()
    with pytest.raises(InvalidStep):
        Step((a, a), (0,))
    with pytest.raises(CacheRefused):
        cache.declare_step(step([a, a], [1, 0]))  # positions go back
    cache.declare_step(Step.run(0, 2, a))
    with pytest.raises(AttendError):
        cache.layer_geometry(2)
    for layer in (-1, 2):
        with pytest.raises(AttendError):
            cache.write_and_read(layer, ["x", "y"])
    run_twice = [cache.write_and_read(0, ["x", "y"]) for _ in range(2)]
    assert run_twice[0] == run_twice[1] == [[(0, "x")], [(0, "x"), (1, "y")]]
    cache.finish_step()
    assert pos(cache, a) == 2 and cache.stale_reads == 0
