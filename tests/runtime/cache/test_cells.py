"""``batched-cell``: many sequences over one pool of cells; forks share cells."""
from __future__ import annotations

import pytest

from mlx_pte.runtime.cache import (
    AttendError,
    CacheRefused,
    CellCache,
    InvalidStep,
    Step,
    StepStateError,
)

from .helpers import FLAT, build, mask_rows, ring, run, snapshot, step
from .shadow import ShadowCells


def cells(capacity: int = 16, *policies, cls: type = CellCache, **kw) -> CellCache:
    return build(cls, capacity, *policies, **kw)


def declare(cache: CellCache, ids, positions):
    cache.declare_step(step(ids, positions))
    return cache.step_plan


def test_a_single_sequence_attends_its_own_prefix():
    cache = cells()
    s0 = cache.seq_new()
    plan = declare(cache, [s0] * 4, range(4))
    assert plan.cells.tolist() == [0, 1, 2, 3] and plan.read_len == 4
    assert mask_rows(plan.mask(0)) == ["1...", "11..", "111.", "1111"]
    cache.finish_step()
    plan = declare(cache, [s0], [4])
    assert plan.cells.tolist() == [4]
    assert mask_rows(plan.mask(0)) == ["11111"]


def test_a_second_sequence_sees_only_its_own_cells():
    cache = cells()
    s0, s1 = cache.seq_new(), cache.seq_new()
    run(cache, s0, 0, 4)
    plan = declare(cache, [s1, s1], [0, 1])
    assert plan.cells.tolist() == [4, 5] and plan.read_len == 6
    assert mask_rows(plan.mask(0)) == ["....1.", "....11"]


def test_a_batched_prefill_keeps_sequences_apart():
    cache = cells()
    s0, s1 = cache.seq_new(), cache.seq_new()
    plan = declare(cache, [s0, s0, s0, s1, s1], [0, 1, 2, 0, 1])
    assert plan.cells.tolist() == [0, 1, 2, 3, 4]
    assert mask_rows(plan.mask(0)) == ["1....", "11...", "111..", "...1.", "...11"]


def test_decode_and_prefill_share_one_step():
    cache = cells()
    s0, s1 = cache.seq_new(), cache.seq_new()
    run(cache, s0, 0, 2)
    plan = declare(cache, [s0, s1, s1], [2, 0, 1])
    assert plan.cells.tolist() == [2, 3, 4]
    assert mask_rows(plan.mask(0)) == ["111..", "...1.", "...11"]
    cache.finish_step()
    assert (cache.pos(s0), cache.pos(s1)) == (3, 2)


def test_positions_must_be_newer_per_sequence():
    cache = cells()
    s0, s1 = cache.seq_new(), cache.seq_new()
    cache.declare_step(step([s0, s1], [0, 0]))
    cache.finish_step()
    with pytest.raises(CacheRefused, match="already holds position 0"):
        cache.declare_step(step([s0, s1], [1, 0]))
    cache.declare_step(step([s0, s1], [1, 1]))


def test_every_layer_reads_the_one_placement():
    cache = cells(16, FLAT, FLAT)
    s0 = cache.seq_new()
    plan = declare(cache, [s0, s0], [0, 1])
    assert plan.layer_windows == (0, 0)
    assert plan.mask(0) is plan.mask(0)  # built once per window, shared by its layers
    with pytest.raises(ValueError):
        plan.mask(0)[0, 0] = False  # read-only: no layer can disturb another's mask
    cache.finish_step()
    assert cache.free_cells() == 14


def test_a_fork_shares_cells_and_removal_refcounts_them():
    cache = cells()
    s0 = cache.seq_new()
    run(cache, s0, 0, 4)
    fork = cache.seq_clone(s0, 4)
    assert cache.free_cells() == 12
    assert (cache.pos(fork), cache.seq_len(fork)) == (4, 4)
    cache.seq_rm(s0)
    assert cache.pos(fork) == 4 and cache.free_cells() == 12
    cache.seq_rm(fork)
    assert cache.free_cells() == 16 and cache.used_end() == 0


def test_seq_new_hands_out_the_lowest_free_id():
    cache = cells(16, max_seqs=3)
    assert cache.max_seqs() == 3
    a, b, c = (cache.seq_new() for _ in range(3))
    assert (a, b, c) == (0, 1, 2)
    with pytest.raises(CacheRefused, match="all 3 sequence slots"):
        cache.seq_new()
    cache.seq_rm(b)  # an empty reserved id is released by seq_rm
    assert cache.seq_new() == 1
    with pytest.raises(CacheRefused, match="not live"):
        cache.declare_step(Step.run(0, 1, seq_id=40))
    cache.clear()
    assert cache.live_seqs() == () and cache.seq_new() == 0
    assert cells().max_seqs() is None


def test_a_fork_can_share_a_prefix_only():
    cache = cells()
    s0 = cache.seq_new()
    run(cache, s0, 0, 4)
    fork = cache.seq_clone(s0, 2)
    assert (cache.pos(fork), cache.seq_len(fork), cache.pos(s0)) == (2, 2, 4)
    assert cache.free_cells() == 12
    cache.seq_rm(s0)
    assert cache.free_cells() == 14


def test_window_and_sequence_both_narrow_the_mask():
    cache = cells(16, ring(2), ring(2))
    s0, s1 = cache.seq_new(), cache.seq_new()
    run(cache, s0, 0, 3)
    plan = declare(cache, [s1, s0], [0, 3])
    assert plan.cells.tolist() == [3, 4] and plan.read_len == 5
    assert mask_rows(plan.mask(2)) == ["...1.", "..1.1"]


def test_a_verb_between_layers_invalidates_the_step():
    cache = cells()
    s0 = cache.seq_new()
    run(cache, s0, 0, 2)
    plan = declare(cache, [s0], [2])
    cache.rewind(s0, 1)
    assert not cache.is_declared
    with pytest.raises(StepStateError):
        plan.cell_pos  # the plan no longer describes the pool
    with pytest.raises(StepStateError):
        cache.finish_step()


def test_rewind_drops_the_tail():
    cache = cells()
    s0 = cache.seq_new()
    run(cache, s0, 0, 5)
    with pytest.raises(CacheRefused, match="cannot grow"):
        cache.rewind(s0, 6)
    cache.rewind(s0, 2)
    assert (cache.pos(s0), cache.seq_len(s0), cache.free_cells()) == (2, 2, 14)
    cache.rewind(s0, 0)
    assert cache.free_cells() == 16 and cache.used_end() == 0


def test_refilled_holes_keep_the_mask_on_positions():
    cache = cells()
    s0, s1 = cache.seq_new(), cache.seq_new()
    run(cache, s0, 0, 2)
    run(cache, s1, 0, 2)
    cache.seq_rm(s0)
    plan = declare(cache, [s1, s1], [2, 3])
    assert plan.cells.tolist() == [0, 1] and plan.read_len == 4
    assert mask_rows(plan.mask(0)) == ["1.11", "1111"]


def test_a_position_the_sequence_still_holds_is_refused():
    cache = cells()
    s0 = cache.seq_new()
    run(cache, s0, 0, 5)
    cache.rewind(s0, 3)
    for ids, positions in (([s0], [0]), ([s0, s0], [5, 4])):
        with pytest.raises(CacheRefused):
            cache.declare_step(step(ids, positions))
    standing = declare(cache, [s0], [3])
    with pytest.raises(CacheRefused):
        cache.declare_step(step([s0], [0]))
    assert cache.step_plan is standing
    declare(cache, [s0], [4])  # a gap is allowed


@pytest.mark.parametrize(
    "window, positions, last_row",
    [(4, [0, 1, 2, 3], "1111"), (3, [0, 1, 2, 3], ".111"), (2, [0, 5], ".1"), (8, [0, 5], "11")],
)
def test_the_window_bounds_each_query_by_position(window, positions, last_row):
    cache = cells(16, ring(window))
    s0 = cache.seq_new()
    plan = declare(cache, [s0] * len(positions), positions)
    assert mask_rows(plan.mask(window))[-1] == last_row


def test_layers_sharing_a_window_share_a_mask():
    cache = cells(16, FLAT, ring(2), ring(2))
    s0 = cache.seq_new()
    plan = declare(cache, [s0] * 4, range(4))
    assert mask_rows(plan.mask(0))[2] == "111."
    assert mask_rows(plan.mask(2))[2] == ".11."
    w1, w2 = plan.layer_windows[1:]
    assert plan.mask(w1) is plan.mask(w2)
    cache.finish_step()
    assert cache.free_cells() == 12


def test_the_step_protocol_is_enforced():
    cache = cells(4)
    s0 = cache.seq_new()
    with pytest.raises(InvalidStep):
        Step((), ())
    refused = [
        lambda: cache.declare_step(Step.run(0, 5, s0)),  # 5 tokens, 4 cells
        lambda: cache.declare_step(Step.run(0, 1, 64)),
        lambda: cache.seq_clone(64, 1),
        lambda: cache.seq_clone(s0, 1),  # s0 holds nothing
        lambda: cache.seq_rm(-1),
    ]
    before = snapshot(cache)
    for call in refused:
        with pytest.raises(CacheRefused):
            call()
        assert snapshot(cache) == before
    with pytest.raises(StepStateError):
        cache.finish_step()
    with pytest.raises(InvalidStep):
        Step((s0, s0), (0,))
    for layer in (-1, 2):
        with pytest.raises(AttendError):
            cache.layer_geometry(layer)
    run(cache, s0, 0, 2)
    assert cache.pos(s0) == 2


def test_clear_returns_every_cell():
    cache = cells(4, cls=ShadowCells)
    s0 = cache.seq_new()
    run(cache, s0, 0, 3)
    with pytest.raises(CacheRefused, match="needs 2 cells, 1 of 4 are free"):
        cache.declare_step(Step.run(3, 2, s0))
    cache.declare_step(Step.run(3, 1, s0))
    cache.clear()
    assert (cache.free_cells(), cache.used_end(), cache.live_seqs()) == (4, 0, ())
    assert not cache.is_declared
    assert cache.hooks == [("clear", 4)]


def test_hooks_run_after_the_bookkeeping():
    cache = cells(8, cls=ShadowCells)
    s0 = cache.seq_new()
    run(cache, s0, 0, 3)
    fork = cache.seq_clone(s0, 2)
    cache.seq_rm(s0)
    assert cache.hooks == [("fork", s0, fork, 2, 2), ("release", s0, 6)]


def test_mixed_masks_survive_source_append_and_branch():
    # flat + ring(4), m = 1: the mask keys off positions and owners, never cell order.
    cache = cells(128, FLAT, ring(4), max_write=1)
    source = cache.seq_new()
    run(cache, source, 0, 4)
    snap = cache.seq_clone(source, 4)
    cache.declare_step(step([source, source], [4, 5]))
    assert cache.step_plan.cells.tolist() == [4, 5]
    cache.finish_step()
    branch = cache.seq_clone(snap, 4)
    plan = declare(cache, [branch], [4])
    assert plan.cells.tolist() == [6]
    assert mask_rows(plan.mask(0)) == ["1111..1"]
    assert mask_rows(plan.mask(4)) == [".111..1"]
    cache.finish_step()
    assert (cache.pos(source), cache.pos(snap)) == (6, 4)
    cache.seq_rm(source)
    cache.seq_rm(snap)
    assert cache.pos(branch) == 5 and cache.free_cells() == 128 - 5
    cache.seq_rm(branch)
    assert cache.free_cells() == 128


def test_reusing_the_source_id_does_not_change_the_clone():
    cache = cells(32)
    source = cache.seq_new()
    run(cache, source, 0, 4)
    clone = cache.seq_clone(source, 3)
    cache.seq_rm(source)
    assert cache.seq_new() == source
    run(cache, source, 0, 5)
    assert (cache.pos(clone), cache.pos(source)) == (3, 5)
    cache.seq_rm(clone)
    cache.seq_rm(source)
    assert cache.free_cells() == 32


def test_usage_counts_shared_cells_once():
    cache = cells(16, FLAT, ring(2))
    s0 = cache.seq_new()
    run(cache, s0, 0, 4)
    cache.seq_clone(s0, 3)
    usage = cache.usage()
    assert usage.logical_positions == 4 + 3
    assert usage.physical_slots == 4 * 2  # 4 cells in each of 2 layers


def test_abort_claims_nothing():
    cache = cells(8)
    s0 = cache.seq_new()
    run(cache, s0, 0, 2)
    cache.declare_step(Step.run(2, 3, s0))
    cache.abort_step()
    assert (cache.pos(s0), cache.free_cells(), cache.used_end()) == (2, 6, 2)
