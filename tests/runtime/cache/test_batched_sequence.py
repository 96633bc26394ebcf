"""``batched-sequence``: private dense histories sharing one logical capacity."""
from __future__ import annotations

import pytest

from mlx_pte.runtime.cache import (
    BatchedSequenceCache,
    CacheRefused,
    InvalidStep,
    Run,
    Step,
    StepStateError,
)

from .helpers import FLAT, build, ring, run, snapshot, step


def rows(capacity: int = 16, *policies, **kw) -> BatchedSequenceCache:
    return build(BatchedSequenceCache, capacity, *policies, **kw)


def spans(cache: BatchedSequenceCache, layer: int = 0):
    return [(span.seq_id, span.count, plan) for span, plan in cache.step_plan.runs_for_layer(layer)]


def test_spans_follow_token_order():
    cache = rows()
    a, b = cache.seq_new(), cache.seq_new()
    cache.declare_step(step([a, a, a, b, b], [0, 1, 2, 0, 1]))
    (sa, na, pa), (sb, nb, pb) = spans(cache)
    assert (sa, na, sb, nb) == (a, 3, b, 2)
    assert pa.write == (Run(0, 3),) and pb.write == (Run(0, 2),)
    cache.finish_step()
    assert (cache.pos(a), cache.pos(b)) == (3, 2)


def test_decode_continues_each_private_history():
    cache = rows()
    a, b = cache.seq_new(), cache.seq_new()
    run(cache, a, 0, 3)
    run(cache, b, 0, 2)
    cache.declare_step(step([a, b], [3, 2]))
    (_, _, pa), (_, _, pb) = spans(cache)
    assert (pa.write[0].start, pb.write[0].start) == (3, 2)
    assert (pa.read_len, pb.read_len) == (4, 3)


def test_a_sequence_spanned_twice_continues_across_both():
    cache = rows()
    a, b = cache.seq_new(), cache.seq_new()
    cache.declare_step(step([a, b, a], [0, 0, 1]))
    planned = spans(cache)
    assert [(s, n) for s, n, _ in planned] == [(a, 1), (b, 1), (a, 1)]
    assert [p.write[0].start for _, _, p in planned] == [0, 0, 1]
    assert planned[2][2].read == (Run(0, 2),)  # a's second span reads its first
    cache.finish_step()
    assert (cache.pos(a), cache.pos(b)) == (2, 1)


def test_every_layer_plans_the_same_step():
    cache = rows(16, FLAT, FLAT)
    a = cache.seq_new()
    cache.declare_step(Step.run(0, 2, a))
    assert cache.step_plan.runs_for_layer(1) == cache.step_plan.runs_for_layer(0)
    cache.finish_step()
    assert cache.pos(a) == 2


def test_positions_must_continue_the_sequence():
    cache = rows()
    a = cache.seq_new()
    standing = cache.declare_step(Step.run(0, 1, a))
    before = snapshot(cache)
    for positions in ([1, 2], [0, 2]):
        with pytest.raises(CacheRefused, match="continues at position 0"):
            cache.declare_step(step([a, a], positions))
        assert snapshot(cache) == before and cache.step_plan is standing
    assert cache.pos(a) == 0
    cache.declare_step(step([a, a], [0, 1]))


def test_sequences_share_one_capacity():
    cache = rows(4)
    a, b = cache.seq_new(), cache.seq_new()
    run(cache, a, 0, 2)
    run(cache, b, 0, 2)
    verdict = cache.check_step(Step.run(2, 1, a))
    assert not verdict and "0 of 4 are free" in verdict.reason
    with pytest.raises(CacheRefused):
        cache.declare_step(Step.run(2, 1, a))
    with pytest.raises(CacheRefused, match="does not fit"):
        cache.seq_clone(a, 1)
    cache.seq_rm(b)
    cache.declare_step(Step.run(2, 1, a))


def test_room_is_weighed_once_for_the_whole_step():
    cache = rows(4)
    a, b = cache.seq_new(), cache.seq_new()
    run(cache, a, 0, 1)
    run(cache, b, 0, 1)
    with pytest.raises(CacheRefused, match="needs 4 positions, 2 of 4"):
        cache.declare_step(step([a, a, b, b], [1, 2, 1, 2]))
    cache.declare_step(step([a, b], [1, 1]))


def test_rewind_drops_a_tail_and_rm_drops_the_sequence():
    cache = rows()
    a, b = cache.seq_new(), cache.seq_new()
    run(cache, a, 0, 3)
    run(cache, b, 0, 3)
    with pytest.raises(CacheRefused, match="cannot grow"):
        cache.rewind(a, 4)
    cache.rewind(a, 2)
    assert (cache.pos(a), cache.pos(b), cache.held()) == (2, 3, 5)
    cache.seq_rm(a)
    assert cache.held() == 3 and cache.live_seqs() == (b,)
    with pytest.raises(CacheRefused, match="not live"):
        cache.pos(a)
    assert cache.seq_new() == a


def test_undeclared_ids_are_refused_and_empty_sequences_cannot_fork():
    cache = rows()
    a = cache.seq_new()
    assert cache.max_seqs() is None
    with pytest.raises(CacheRefused, match="not live"):
        cache.declare_step(step([a, a + 1], [0, 0]))
    with pytest.raises(InvalidStep):
        cache.declare_step(step([], []))
    for src in (a, a + 1):
        assert not cache.can_clone(src, 1)
        with pytest.raises(CacheRefused):
            cache.seq_clone(src, 1)
    assert cache.live_seqs() == (a,)


def test_a_fork_copies_the_prefix_and_diverges_after():
    cache = rows()
    a = cache.seq_new()
    run(cache, a, 0, 3)
    fork = cache.seq_clone(a, 2)
    assert (cache.pos(fork), cache.pos(a), cache.held()) == (2, 3, 5)
    cache.declare_step(step([a, fork], [3, 2]))
    cache.finish_step()
    assert (cache.pos(a), cache.pos(fork)) == (4, 3)


def test_a_fork_is_bounded_by_capacity_and_the_ring():
    cache = rows(4)
    a = cache.seq_new()
    run(cache, a, 0, 3)
    with pytest.raises(CacheRefused, match="does not fit"):
        cache.seq_clone(a, 3)
    cache.seq_clone(a, 1)

    cache = rows(16, ring(2), ring(2))  # m defaults to the window
    a = cache.seq_new()
    run(cache, a, 0, 2)
    run(cache, a, 2, 2)
    assert cache.rewind_floor(a) == 2
    with pytest.raises(CacheRefused, match="from 2 on"):
        cache.seq_clone(a, 1)
    assert cache.pos(cache.seq_clone(a, 2)) == 2


def test_abort_restores_lengths_but_raises_the_high_water_mark():
    cache = rows(16, FLAT, ring(3), max_write=2)
    a, b = cache.seq_new(), cache.seq_new()
    run(cache, a, 0, 2)
    cache.declare_step(step([a, a, b], [2, 3, 0]))
    cache.abort_step()
    assert (cache.pos(a), cache.pos(b), cache.held()) == (2, 0, 2)
    assert cache.rewind_floor(a) == 2  # written 4 - max_write 2
    assert not cache.can_rewind(a, 1)
    with pytest.raises(StepStateError):
        cache.abort_step()


def test_every_verb_drops_the_declared_step():
    cache = rows()
    a = cache.seq_new()
    run(cache, a, 0, 2)
    verbs = [
        lambda: cache.seq_new(),
        lambda: cache.seq_clone(a, 1),
        lambda: cache.rewind(a, 2),
        lambda: cache.seq_rm(cache.live_seqs()[-1]),
        cache.clear,
    ]
    for verb in verbs:
        cache.declare_step(Step.run(2, 1, a))
        verb()
        assert not cache.is_declared


def test_usage_reports_logical_and_physical():
    cache = rows(64, FLAT, ring(2), max_write=1)  # ring: 2 slots
    a = cache.seq_new()
    for p in range(5):
        run(cache, a, p, 1)
    fork = cache.seq_clone(a, 4)
    usage = cache.usage()
    assert usage.logical_positions == 5 + 4
    # flat rows: the lengths; ring rows: min(written, slots) per sequence.
    assert usage.physical_slots == (5 + 2) + (4 + 2)
    assert cache.pos(fork) == 4


def test_a_new_sequence_allocates_only_past_the_rows_ever_used():
    cache = rows()
    assert cache.new_seq_allocates()  # nothing held: the first sequence takes a new row
    a, _ = cache.seq_new(), cache.seq_new()
    assert cache.new_seq_allocates()
    cache.seq_rm(a)
    assert not cache.new_seq_allocates()  # a's row is free again
    cache.seq_new()
    assert cache.new_seq_allocates()
