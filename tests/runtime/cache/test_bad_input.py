"""Bad input: each a typed error whose message says what to do, and nothing changed."""
from __future__ import annotations

import numpy as np
import pytest

from mlx_pte.runtime.cache import (
    AttendError,
    BatchedSequenceCache,
    CacheConfig,
    CacheGeometry,
    CacheRefused,
    CellCache,
    InvalidCacheConfig,
    InvalidStep,
    LayerGeometry,
    LayerPolicy,
    PolicyKind,
    SingleCache,
    Step,
)
from mlx_pte.runtime.cache.step import MAX_INDEX

from .helpers import FLAT, build, geometry, ring, run, snapshot

BAD_INTS = [-1, MAX_INDEX + 1, 1.0, 2.5, "1", None, True, [1]]


@pytest.mark.parametrize("bad", BAD_INTS + [float("nan")])
@pytest.mark.parametrize("field", ["seq_ids", "positions"])
def test_a_step_takes_integers_in_range(field, bad):
    ids, positions = [0, 0], [0, 1]
    (ids if field == "seq_ids" else positions)[1] = bad
    with pytest.raises(InvalidStep, match="integers"):
        Step(tuple(ids), tuple(positions))


@pytest.mark.parametrize(
    "ids, positions, match",
    [((), (), "at least one token"), ((0, 0), (0,), "one position per token"),
     ((0,), (0, 1), "one position per token"), (3, (0,), "sequence of integers"),
     ((0,), None, "sequence of integers")],
)
def test_empty_ragged_or_scalar_steps_are_refused(ids, positions, match):
    with pytest.raises(InvalidStep, match=match):
        Step(ids, positions)


def test_a_step_accepts_integers_of_any_kind_as_python_ints():
    s = Step(np.array([0, 0]), (np.int32(3), 4))
    assert s.seq_ids == (0, 0) and s.positions == (3, 4)
    assert all(type(v) is int for v in s.seq_ids + s.positions)
    assert Step.run(MAX_INDEX, 1).positions == (MAX_INDEX,)


@pytest.mark.parametrize(
    "make",
    [
        lambda: CacheConfig(0),
        lambda: CacheConfig(-4),
        lambda: CacheConfig(MAX_INDEX + 1),
        lambda: CacheConfig(4.0),
        lambda: CacheConfig("4"),
        lambda: CacheConfig(True),
        lambda: CacheConfig(8, max_write=0),
        lambda: CacheConfig(8, max_write=1.5),
        lambda: CacheConfig(8, initial_capacity=-1),
        lambda: CacheConfig(8, kv_dtype="int8"),
        lambda: CacheConfig(8, max_seqs=0),
        lambda: LayerPolicy(PolicyKind.FLAT, 4),
        lambda: LayerPolicy(PolicyKind.FLAT, 0.0),
        lambda: LayerPolicy.ring(0),
        lambda: LayerPolicy.ring(-1),
        lambda: LayerPolicy.ring(2.0),
        lambda: LayerPolicy.ring(MAX_INDEX + 1),
        lambda: LayerPolicy("sliding", 4),
        lambda: LayerPolicy.from_window(-1),
        lambda: LayerGeometry(FLAT, 0, 8),
        lambda: LayerGeometry(FLAT, 2, -8),
        lambda: LayerGeometry(FLAT, 2, 8, v_head_dim=0),
        lambda: LayerGeometry("flat", 2, 8),
        lambda: CacheGeometry(()),
        lambda: CacheGeometry((FLAT,)),
        lambda: CacheGeometry(5),
    ],
)
def test_bad_geometry_and_config_values_are_refused(make):
    with pytest.raises(InvalidCacheConfig):
        make()


def test_config_values_are_stored_as_python_ints():
    config = CacheConfig(np.int64(8), max_write=np.int32(2))
    assert type(config.capacity) is int and type(config.max_write) is int
    assert LayerPolicy.from_window(3) == LayerPolicy.ring(3)
    assert LayerPolicy.from_window(0) == FLAT


@pytest.mark.parametrize("cls", [SingleCache, CellCache, BatchedSequenceCache])
def test_a_cache_needs_a_geometry_and_a_config(cls):
    with pytest.raises(InvalidCacheConfig):
        cls(CacheConfig(8), geometry())
    with pytest.raises(InvalidCacheConfig):
        cls(geometry(), 8)


@pytest.mark.parametrize("cls", [SingleCache, CellCache, BatchedSequenceCache])
def test_declare_step_takes_a_step(cls):
    cache = build(cls, 8, FLAT)
    before = snapshot(cache)
    for bad in ((0, 0), [0], None):
        with pytest.raises(InvalidStep, match="Step"):
            cache.declare_step(bad)
    assert snapshot(cache) == before


@pytest.mark.parametrize("cls", [CellCache, BatchedSequenceCache])
def test_verbs_refuse_bad_ids_and_positions_and_change_nothing(cls):
    cache = build(cls, 16, FLAT, ring(4))
    a, b = cache.seq_new(), cache.seq_new()
    run(cache, a, 0, 3)
    run(cache, b, 0, 1)
    before = snapshot(cache)
    calls = []
    for bad in BAD_INTS + [2**40, 7]:
        calls += [
            lambda bad=bad: cache.seq_rm(bad),
            lambda bad=bad: cache.pos(bad),
            lambda bad=bad: cache.rewind(bad, 0),
            lambda bad=bad: cache.seq_clone(bad, 1),
            lambda bad=bad: cache.rewind(a, bad),
            lambda bad=bad: cache.seq_clone(a, bad),
        ]
    for call in calls:
        with pytest.raises(CacheRefused):
            call()
        assert snapshot(cache) == before
    # True is not id 1, whatever Python's int subclassing says.
    assert b == 1 and cache.live_seqs() == (0, 1)


def test_single_verbs_refuse_bad_values_and_change_nothing():
    cache = build(SingleCache, 16, FLAT)
    run(cache, 0, 0, 3)
    before = snapshot(cache)
    for bad in BAD_INTS:
        for call in (lambda: cache.rewind(0, bad), lambda: cache.rewind(bad, 0), lambda: cache.seq_rm(bad)):
            with pytest.raises(CacheRefused):
                call()
            assert snapshot(cache) == before
    for bad in (-1, 1.5, "2", None, True):
        with pytest.raises(InvalidStep, match="non-negative integer"):
            cache.can_extend(0, bad)
    assert snapshot(cache) == before


@pytest.mark.parametrize("cls", [SingleCache, CellCache, BatchedSequenceCache])
@pytest.mark.parametrize("layer", [-1, 2, 1.0, "0", None])
def test_unknown_layers_are_attend_errors(cls, layer):
    cache = build(cls, 8, FLAT, ring(2))
    seq = 0 if cls is SingleCache else cache.seq_new()
    cache.declare_step(Step.run(0, 1, seq))
    with pytest.raises(AttendError, match="does not exist"):
        cache.layer_geometry(layer)
    if cls is not CellCache:
        with pytest.raises(AttendError, match="does not exist"):
            cache.step_plan.runs_for_layer(layer)


def test_capacity_counts_are_refused_not_clamped():
    cache = build(BatchedSequenceCache, 4, FLAT)
    a = cache.seq_new()
    before = snapshot(cache)
    with pytest.raises(CacheRefused, match="needs 5 positions"):
        cache.declare_step(Step.run(0, 5, a))
    assert snapshot(cache) == before
    single = build(SingleCache, 4, FLAT)
    with pytest.raises(CacheRefused, match="capacity is 4"):
        single.declare_step(Step.run(0, 5))
