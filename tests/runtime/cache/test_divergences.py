"""One behaviour for each row where upstream implementations disagreed (neutral_cache.md §14)."""
from __future__ import annotations

import pytest

from mlx_pte.runtime.cache import (
    ALLOWED,
    BatchedSequenceCache,
    CacheRefused,
    CellCache,
    Step,
    Verdict,
)

from .helpers import FLAT, build, ring, run, snapshot, step
from .shadow import ShadowBatched, ShadowCells, feed

BATCHED = [CellCache, BatchedSequenceCache]


@pytest.mark.parametrize("cls", BATCHED)
def test_ids_are_the_lowest_free_and_unbounded_unless_configured(cls):
    cache = build(cls, 256, FLAT)
    assert [cache.seq_new() for _ in range(3)] == [0, 1, 2]
    cache.seq_rm(2)
    cache.seq_rm(0)
    assert [cache.seq_new() for _ in range(3)] == [0, 2, 3]
    assert [cache.seq_new() for _ in range(96)][-1] == 99
    bounded = build(cls, 16, FLAT, max_seqs=2)
    a = bounded.seq_new()
    run(bounded, a, 0, 2)
    bounded.seq_new()
    before = snapshot(bounded)
    for verb in (bounded.seq_new, lambda: bounded.seq_clone(a, 1)):
        with pytest.raises(CacheRefused, match="all 2 sequence slots"):
            verb()
        assert snapshot(bounded) == before


@pytest.mark.parametrize("cls", [ShadowCells, ShadowBatched])
def test_the_same_layer_twice_in_a_step_rewrites_it_and_commits_once(cls):
    # Plans belong to the step, not the layer: a repeated layer (a KV-shared layer, or a
    # retried one) writes the same rows again and the last write stands.
    cache = build(cls, 16, FLAT, ring(2), max_write=2)
    a = cache.seq_new()
    cache.declare_step(Step.run(0, 2, a))
    assert cache.step_plan is cache.step_plan
    for layer in (0, 1):
        cache.write_and_read(layer, ["first", "first"])
        assert cache.write_and_read(layer, ["x", "y"]) == [[(0, "x")], [(0, "x"), (1, "y")]]
    cache.finish_step()
    assert cache.pos(a) == 2
    cache.declare_step(Step.run(2, 1, a))
    assert cache.write_and_read(1, ["z"]) == [[(1, "y"), (2, "z")]]
    assert cache.stale_reads == 0


@pytest.mark.parametrize("cls", [ShadowCells, ShadowBatched])
def test_a_placement_refusal_keeps_the_declaration(cls):
    # Positions travel with the declaration, so bad positions are refused at declare time
    # and the standing declaration still runs.
    cache = build(cls, 16, FLAT)
    a = cache.seq_new()
    run(cache, a, 0, 2)
    cache.declare_step(Step.run(2, 1, a))
    with pytest.raises(CacheRefused):
        cache.declare_step(Step.run(1, 1, a))
    assert cache.write_and_read(0, ["v"])[0][-1] == (2, "v")
    cache.finish_step()
    assert cache.pos(a) == 3


def test_sequence_layouts_need_consecutive_positions():
    cache = build(BatchedSequenceCache, 16, FLAT)
    a = cache.seq_new()
    run(cache, a, 0, 2)
    for positions in ([3], [2, 4], [1]):
        assert not cache.check_step(step([a] * len(positions), positions))
    assert cache.check_step(step([a, a], [2, 3]))


def test_cells_need_strictly_increasing_positions_and_allow_gaps():
    cache = build(CellCache, 16, FLAT)
    a = cache.seq_new()
    run(cache, a, 0, 2)
    for positions in ([1], [3, 3], [5, 4]):
        assert not cache.check_step(step([a] * len(positions), positions))
    cache.declare_step(step([a, a], [5, 9]))
    cache.finish_step()
    assert (cache.pos(a), cache.seq_len(a)) == (10, 4)


def test_cells_have_no_rewind_floor():
    # A window on the cell layout only narrows the mask; nothing is evicted.
    cache = build(ShadowCells, 32, FLAT, ring(2), max_write=1)
    a = cache.seq_new()
    for p in range(10):
        feed(cache, a, p, [p])
    assert cache.rewind_floor(a) == 0
    cache.rewind(a, 1)
    cache.declare_step(Step.run(1, 1, a))
    assert cache.write_and_read(1, ["new"]) == [[(0, 0), (1, "new")]]
    assert cache.stale_reads == 0


def test_sequence_layouts_floor_at_written_minus_max_write():
    cache = build(BatchedSequenceCache, 32, FLAT, ring(4), max_write=2)
    a = cache.seq_new()
    for p in range(0, 10, 2):
        run(cache, a, p, 2)
    assert cache.rewind_floor(a) == 8
    cache.rewind(a, 8)
    assert cache.rewind_floor(a) == 8  # a rewind never lowers the high-water mark


@pytest.mark.parametrize("cls", BATCHED)
@pytest.mark.parametrize("upto", [5, 0, -1])
def test_a_clone_is_exact_or_refused(cls, upto):
    cache = build(cls, 16, FLAT)
    a = cache.seq_new()
    run(cache, a, 0, 4)
    before = snapshot(cache)
    assert not cache.can_clone(a, upto)
    with pytest.raises(CacheRefused, match="must"):
        cache.seq_clone(a, upto)
    assert snapshot(cache) == before
    for keep in range(1, 5):
        assert cache.pos(cache.seq_clone(a, keep)) == keep


def test_a_cell_clone_must_end_on_a_held_position():
    cache = build(CellCache, 16, FLAT)
    a = cache.seq_new()
    cache.declare_step(step([a, a], [0, 4]))
    cache.finish_step()
    with pytest.raises(CacheRefused, match="holds no position 2"):
        cache.seq_clone(a, 3)
    assert cache.pos(cache.seq_clone(a, 1)) == 1
    assert cache.pos(cache.seq_clone(a, 5)) == 5


@pytest.mark.parametrize("cls", BATCHED)
def test_verbs_raise_and_queries_answer_with_the_same_reason(cls):
    cache = build(cls, 4, FLAT)
    a = cache.seq_new()
    run(cache, a, 0, 3)
    pairs = [
        (lambda: cache.check_step(Step.run(3, 2, a)), lambda: cache.declare_step(Step.run(3, 2, a))),
        (lambda: cache.can_rewind(a, 4), lambda: cache.rewind(a, 4)),
        (lambda: cache.can_clone(a, 0), lambda: cache.seq_clone(a, 0)),
        (lambda: cache.can_rewind(9, 0), lambda: cache.rewind(9, 0)),
    ]
    for query, verb in pairs:
        verdict = query()
        assert isinstance(verdict, Verdict) and not verdict and verdict.reason
        with pytest.raises(CacheRefused) as refused:
            verb()
        assert refused.value.reason == verdict.reason
    assert cache.check_step(Step.run(3, 1, a)) == ALLOWED and ALLOWED


@pytest.mark.parametrize("cls", BATCHED)
def test_queries_of_an_unknown_sequence_are_refused_not_zero(cls):
    cache = build(cls, 4, FLAT)
    for query in (cache.pos, cache.rewind_floor, cache.seq_rm):
        with pytest.raises(CacheRefused, match="not live"):
            query(3)
