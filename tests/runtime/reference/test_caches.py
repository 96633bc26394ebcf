"""The three reference kinds against the cacheless history oracle."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mlx_pte.runtime.cache import (
    CACHE_FACTORY,
    KINDS,
    AttendError,
    CacheConfig,
    CacheRefused,
    Step,
    StepStateError,
)
from mlx_pte.runtime.reference import (
    BACKEND_ID,
    ReferenceBatchedSequenceCache,
    ReferenceCellCache,
    ReferenceSingleCache,
)

from .oracle import HistoryOracle
from .scenario import (
    TORCH,
    attend_all,
    expected_all,
    geometry,
    random_step,
    run_and_check,
    stored,
)


N_Q = 4


def build(kind: str, windows, capacity: int = 64, **config):
    config.setdefault("max_write", 8)
    geo = geometry(windows, n_kv=2, head_dim=8, v_head_dim=config.pop("v_head_dim", 8))
    cache = CACHE_FACTORY.build(BACKEND_ID, kind, geo, CacheConfig(capacity=capacity, **config))
    return cache, HistoryOracle(tuple(windows)), geo


def test_every_kind_is_registered() -> None:
    assert CACHE_FACTORY.kinds(BACKEND_ID) == tuple(sorted(KINDS))
    classes = {"single": ReferenceSingleCache, "batched-cell": ReferenceCellCache,
               "batched-sequence": ReferenceBatchedSequenceCache}
    for kind, cls in classes.items():
        assert type(build(kind, (0,))[0]) is cls


# Chunk sizes of one sequence's steps: prefill, decode, chunked prefill, past the windows.
SCHEDULES = [(6,), (4, 1, 1, 1), (3, 3), (2, 2, 2, 1, 1, 1, 1)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_one_sequence_matches_the_oracle(kind: str, schedule, softcap: float) -> None:
    # flat, a ring narrower than a chunk, a ring as wide as the history, Dv != D
    windows = (0, 2, 6)
    cache, oracle, geo = build(kind, windows, max_write=6, initial_capacity=2, v_head_dim=5)
    rng = np.random.default_rng(len(schedule))
    seq = cache.seq_new()
    oracle.new(seq)
    at = 0
    for count in schedule:
        step = Step.run(at, count, seq)
        run_and_check(cache, oracle, step, random_step(rng, geo, N_Q, count), softcap=softcap)
        at += count


@pytest.mark.parametrize("kind", ["batched-cell", "batched-sequence"])
def test_repeated_spans_keep_token_order_and_see_earlier_spans(kind: str) -> None:
    cache, oracle, geo = build(kind, (0, 2), max_write=3)
    rng = np.random.default_rng(3)
    a, b = cache.seq_new(), cache.seq_new()
    oracle.new(a), oracle.new(b)
    step = Step((a, a, b, a), (0, 1, 0, 2))
    run_and_check(cache, oracle, step, random_step(rng, geo, N_Q, 4))
    step = Step((b, a, b), (1, 3, 2))
    run_and_check(cache, oracle, step, random_step(rng, geo, N_Q, 3))


def test_cell_positions_may_leave_gaps() -> None:
    cache, oracle, geo = build("batched-cell", (0, 3))
    rng = np.random.default_rng(4)
    s = cache.seq_new()
    oracle.new(s)
    run_and_check(cache, oracle, Step((s, s, s), (0, 2, 5)), random_step(rng, geo, N_Q, 3))
    run_and_check(cache, oracle, Step((s,), (7,)), random_step(rng, geo, N_Q, 1))


@pytest.mark.parametrize("kind", ["batched-cell", "batched-sequence"])
def test_a_fork_is_a_snapshot_of_the_prefix(kind: str) -> None:
    cache, oracle, geo = build(kind, (0, 3), max_write=4)
    rng = np.random.default_rng(5)
    a = cache.seq_new()
    oracle.new(a)
    run_and_check(cache, oracle, Step.run(0, 4, a), random_step(rng, geo, N_Q, 4))
    run_and_check(cache, oracle, Step.run(4, 2, a), random_step(rng, geo, N_Q, 2))
    b = cache.seq_clone(a, 5)
    oracle.clone(a, b, 5)
    # Both sides write position 5 with different bytes; neither sees the other's.
    run_and_check(cache, oracle, Step((a, b, b), (6, 5, 6)), random_step(rng, geo, N_Q, 3))
    run_and_check(cache, oracle, Step((b, a), (7, 7)), random_step(rng, geo, N_Q, 2))


def test_a_fork_of_a_wrapped_ring_resumes_only_from_its_floor() -> None:
    cache, oracle, geo = build("batched-sequence", (4,), max_write=1)
    rng = np.random.default_rng(6)
    a = cache.seq_new()
    oracle.new(a)
    for p in range(10):
        run_and_check(cache, oracle, Step((a,), (p,)), random_step(rng, geo, N_Q, 1))
    with pytest.raises(CacheRefused, match="retain only positions from 9"):
        cache.seq_clone(a, 6)
    b = cache.seq_clone(a, 9)
    oracle.clone(a, b, 9)
    run_and_check(cache, oracle, Step((b, a), (9, 10)), random_step(rng, geo, N_Q, 2))


def test_flat_forks_copy_only_the_prefix_and_rings_whole() -> None:
    cache, oracle, geo = build("batched-sequence", (0, 3), initial_capacity=2, max_write=8)
    a = cache.seq_new()
    oracle.new(a)
    data = random_step(np.random.default_rng(7), geo, N_Q, 7)
    run_and_check(cache, oracle, Step.run(0, 7, a), data)
    b = cache.seq_clone(a, 7)
    flat, ring = cache._pools[b]
    assert flat.k.rows == 7 and ring.k.rows == 10
    assert torch.equal(flat.v.data, cache._pools[a][0].v.data[:, :, :7])
    assert torch.equal(ring.k.data, cache._pools[a][1].k.data)


def test_pools_grow_by_doubling_and_rings_are_allocated_whole() -> None:
    cache, oracle, geo = build("single", (0, 3), initial_capacity=2, max_write=5)
    oracle.new(0)
    run_and_check(cache, oracle, Step.run(0, 5), random_step(np.random.default_rng(8), geo, N_Q, 5))
    flat, ring = cache._pools
    assert (flat.k.rows, ring.k.rows) == (8, 7)


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_storage_holds_the_kv_dtype(kind: str, kv_dtype: str) -> None:
    cache, oracle, geo = build(kind, (0, 2), kv_dtype=kv_dtype)
    data = random_step(np.random.default_rng(9), geo, N_Q, 3)
    seq = cache.seq_new()
    oracle.new(seq)
    step = Step.run(0, 3, seq)
    cache.declare_step(step)
    outs = attend_all(cache, TORCH, data, 0.5, 0.0)
    # Exact only if K/V are rounded to storage once; attention itself runs in fp32.
    wants = expected_all(oracle, step, stored(data, kv_dtype), 0.5, 0.0)
    for out, want in zip(outs, wants):
        np.testing.assert_allclose(out, want, atol=1e-5, rtol=0)
    pools = cache._pools[seq] if kind == "batched-sequence" else cache._pools
    dtypes = {t.dtype for p in pools for t in (p.k.data, p.v.data)}
    assert dtypes == {getattr(torch, kv_dtype)}


def bad_calls(q, k, v):
    """(layer, q, k, v, softcap, message) for each way a call can break the contract."""
    return [
        (2, q, k, v, 0.0, "cache layer 2 does not exist"),
        (True, q, k, v, 0.0, "cache layer True does not exist"),
        (0, q[0], k, v, 0.0, r"q must be \[1, heads, tokens, dim\]"),
        (0, q, k[:, :, :2], v, 0.0, "k carries 2 tokens but the declared step has 3"),
        (0, q, k[:, :1], v, 0.0, "k heads is 2"),
        (0, q, k, v[:, :1], 0.0, "v heads is 2"),
        (0, q[..., :4], k, v, 0.0, "q head dim is 8"),
        (0, q, k, v[..., :4], 0.0, "v head dim is 8"),
        (0, q[:, :3], k, v, 0.0, "not a multiple"),
        (0, q, k.double(), v, 0.0, "share one dtype"),
        (0, q, k, v, -1.0, "softcap must be >= 0"),
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_call_is_refused_before_anything_is_written(kind: str) -> None:
    cache, oracle, geo = build(kind, (0, 2))
    rng = np.random.default_rng(10)
    seq = cache.seq_new()
    oracle.new(seq)
    run_and_check(cache, oracle, Step.run(0, 2, seq), random_step(rng, geo, N_Q, 2))
    step = Step.run(2, 3, seq)
    data = random_step(rng, geo, N_Q, 3)
    cache.declare_step(step)
    q, k, v = (torch.from_numpy(x[0]) for x in (data.q, data.k, data.v))
    before = [t.clone() for t in _storage(cache)]
    for layer, *args, softcap, message in bad_calls(q, k, v):
        with pytest.raises(AttendError, match=message):
            cache.attend(layer, *args, 0.5, softcap)
    assert all(torch.equal(a, b) for a, b in zip(before, _storage(cache)))
    # The declaration stands: the step then runs as if nothing had happened.
    cache.abort_step()
    run_and_check(cache, oracle, step, data)


def _storage(cache) -> list[torch.Tensor]:
    pools = cache._pools
    layers = [lp for seq in pools.values() for lp in seq] if isinstance(pools, dict) else pools
    return [t for lp in layers for t in (lp.k.data, lp.v.data)]


@pytest.mark.parametrize("kind", KINDS)
def test_attend_needs_a_declared_step(kind: str) -> None:
    cache, _, geo = build(kind, (0,))
    data = random_step(np.random.default_rng(11), geo, N_Q, 1)
    args = [torch.from_numpy(x[0]) for x in (data.q, data.k, data.v)]
    with pytest.raises(StepStateError, match="declare_step"):
        cache.attend(0, *args, 0.5)
    seq = cache.seq_new()
    cache.declare_step(Step((seq,), (0,)))
    cache.finish_step()
    with pytest.raises(StepStateError):
        cache.attend(0, *args, 0.5)


@pytest.mark.parametrize("kind", KINDS)
def test_an_aborted_step_leaves_the_history_as_it_was(kind: str) -> None:
    cache, oracle, geo = build(kind, (0, 3), max_write=3)
    rng = np.random.default_rng(12)
    seq = cache.seq_new()
    oracle.new(seq)
    for at in (0, 3):
        run_and_check(cache, oracle, Step.run(at, 3, seq), random_step(rng, geo, N_Q, 3))
    step = Step.run(6, 3, seq)
    cache.declare_step(step)
    attend_all(cache, TORCH, random_step(rng, geo, N_Q, 3), 0.5, 0.0)
    cache.abort_step()
    run_and_check(cache, oracle, step, random_step(rng, geo, N_Q, 3))


@pytest.mark.parametrize("kind", KINDS)
def test_rewind_then_continue_matches_the_oracle(kind: str) -> None:
    cache, oracle, geo = build(kind, (0, 2), max_write=4)
    rng = np.random.default_rng(13)
    seq = cache.seq_new()
    oracle.new(seq)
    run_and_check(cache, oracle, Step.run(0, 4, seq), random_step(rng, geo, N_Q, 4))
    cache.rewind(seq, 3)
    oracle.rewind(seq, 3)
    run_and_check(cache, oracle, Step.run(3, 3, seq), random_step(rng, geo, N_Q, 3))


@pytest.mark.parametrize("kind", KINDS)
def test_clear_and_seq_rm_drop_storage(kind: str) -> None:
    cache, oracle, geo = build(kind, (0,))
    rng = np.random.default_rng(14)
    seq = cache.seq_new()
    oracle.new(seq)
    run_and_check(cache, oracle, Step.run(0, 3, seq), random_step(rng, geo, N_Q, 3))
    if kind == "batched-sequence":
        cache.seq_rm(seq)
        assert cache._pools == {}
        seq = cache.seq_new()
    cache.clear()
    assert all(t.shape[2] == 0 for t in _storage(cache))
    seq = cache.seq_new()
    oracle = HistoryOracle((0,))
    oracle.new(seq)
    run_and_check(cache, oracle, Step.run(0, 2, seq), random_step(rng, geo, N_Q, 2))


def test_freed_cells_refill_without_leaking_into_new_sequences() -> None:
    cache, oracle, geo = build("batched-cell", (0,), capacity=6)
    rng = np.random.default_rng(15)
    a, b = cache.seq_new(), cache.seq_new()
    oracle.new(a), oracle.new(b)
    step = Step((a, a, b, b, a), (0, 1, 0, 1, 2))
    run_and_check(cache, oracle, step, random_step(rng, geo, N_Q, 5))
    cache.seq_rm(a)
    oracle.remove(a)
    c = cache.seq_new()
    oracle.new(c)
    # c takes a's freed cells 0, 1 and 4; their old bytes must stay invisible.
    cache.declare_step(Step((c, c, c, b), (0, 1, 2, 2)))
    assert cache.step_plan.cells.tolist() == [0, 1, 4, 5]
    cache.abort_step()
    run_and_check(cache, oracle, Step((c, c, c, b), (0, 1, 2, 2)), random_step(rng, geo, N_Q, 4))
