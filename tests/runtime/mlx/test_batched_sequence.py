"""``batched-sequence`` on MLX against the oracle (mlx_runtime.md §9.3, §9.4).

Every case runs twice: with steps of several sequences attended as one padded batch,
and span by span, so both paths answer the same scenarios.
"""
from __future__ import annotations

import numpy as np
import pytest

import mlx_pte.runtime.mlx.blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from mlx_pte.runtime.cache import CACHE_FACTORY, CacheControl
from mlx_pte.runtime.mlx import MLXBatchedSequenceCache, padded

from .helpers import make_driver

KIND = "batched-sequence"


@pytest.fixture(params=["padded", "spans"], autouse=True)
def path(request, monkeypatch):
    """Force the padded batch whenever it applies, or never."""
    monkeypatch.setattr(padded, "SPAN_OVERHEAD_PAIRS", 10**9 if request.param == "padded" else -(10**9))
    return request.param


def test_spans_match_separate_single_caches():
    d = make_driver(KIND, [0, 3], max_write=3)
    a, b = d.cache.seq_new(), d.cache.seq_new()
    d.check([a, a, a, b, b], [0, 1, 2, 0, 1])
    d.check([a, b], [3, 2])
    # The same K/V through two solo caches give the same outputs.
    solo = {s: make_driver("single", [0, 3], max_write=3) for s in (a, b)}
    for s, positions in ((a, [0, 1, 2]), (b, [0, 1])):
        solo[s].check([0] * len(positions), positions)


def test_padded_and_solo_outputs_agree_exactly_in_layout():
    rng = np.random.default_rng(5)
    batched = make_driver(KIND, [0], seed=5)
    solo = [make_driver("single", [0], seed=5) for _ in range(2)]
    a, b = batched.cache.seq_new(), batched.cache.seq_new()
    q = mx.array(rng.standard_normal((1, 4, 5, 8), np.float32))
    k = mx.array(rng.standard_normal((1, 2, 5, 8), np.float32))
    from mlx_pte.runtime.cache import Step

    batched.cache.declare_step(Step((a, a, a, b, b), (0, 1, 2, 0, 1)))
    out = np.array(batched.cache.attend(0, q, k, k, 0.5))
    for s, tokens in ((0, slice(0, 3)), (1, slice(3, 5))):
        n = tokens.stop - tokens.start
        solo[s].cache.declare_step(Step.run(0, n))
        want = np.array(solo[s].cache.attend(0, q[:, :, tokens], k[:, :, tokens], k[:, :, tokens], 0.5))
        np.testing.assert_allclose(out[:, :, tokens], want, atol=1e-6)


def test_decode_continues_each_private_history():
    d = make_driver(KIND, [0, 2], max_write=3)
    a, b, c = (d.cache.seq_new() for _ in range(3))
    d.check([a] * 3 + [b] + [c] * 2, [0, 1, 2, 0, 0, 1])
    for _ in range(3):
        d.check([a, b, c], [d.cache.pos(a), d.cache.pos(b), d.cache.pos(c)])


def test_a_prompt_chunk_beside_decode_rows_batches_the_decode_rows(monkeypatch):
    """The engine's mixed step (decode rows first, then a prompt chunk) is too ragged for
    one padded batch at the default cost; its decode rows still attend as one."""
    monkeypatch.setattr(padded, "SPAN_OVERHEAD_PAIRS", 64)
    d = make_driver(KIND, [0, 5], capacity=96, max_write=8)
    rows = [d.cache.seq_new() for _ in range(4)]
    for seq, n in zip(rows[:3], (20, 17, 23)):
        for at in range(0, n, 8):  # the ring takes at most max_write tokens a step
            d.check([seq] * min(8, n - at), list(range(at, min(n, at + 8))))
    from mlx_pte.runtime.mlx import sequence

    batched = []
    real = sequence.attend_padded

    def spy(pools, batch, q, *rest):
        batched.append((batch.hi - batch.lo, q.shape[2]))
        return real(pools, batch, q, *rest)

    monkeypatch.setattr(sequence, "attend_padded", spy)
    decode = [d.cache.pos(seq) for seq in rows[:3]]
    d.check(rows[:3] + [rows[3]] * 8, decode + list(range(8)))
    assert batched == [(3, 3), (3, 3)]  # per layer: the three decode rows, their three tokens


def test_rows_out_of_order_and_idle_rows_between():
    d = make_driver(KIND, [0, 3], max_write=2)
    s = [d.cache.seq_new() for _ in range(4)]
    d.check([s[0], s[0], s[1], s[2], s[3], s[3]], [0, 1, 0, 0, 0, 1])
    d.check([s[3], s[0]], [2, 2])  # rows 1, 2 idle in between
    d.check([s[2], s[2], s[1]], [1, 2, 1])


def test_sequence_spanned_twice_preserves_order():
    d = make_driver(KIND, [0, 2], max_write=2)
    a, b = d.cache.seq_new(), d.cache.seq_new()
    d.check([a, b, a], [0, 0, 1])
    d.check([a, b, a, b], [2, 1, 3, 2])


def test_window_bounds_each_span_within_its_sequence():
    d = make_driver(KIND, [2], max_write=4)
    a, b = d.cache.seq_new(), d.cache.seq_new()
    d.check([a] * 4 + [b] * 3, [0, 1, 2, 3, 0, 1, 2])
    for _ in range(6):  # decoding past the ring's wrap
        d.check([a, b], [d.cache.pos(a), d.cache.pos(b)])
    d.check([b] * 4 + [a] * 2, list(range(9, 13)) + [10, 11])


def test_storage_dtype_differs_casts_on_write():
    d = make_driver(KIND, [0, 3], kv_dtype="bfloat16")
    a, b = d.cache.seq_new(), d.cache.seq_new()
    d.check([a, a, b], [0, 1, 0], atol=2e-2)
    d.check([a, b], [2, 1], atol=2e-2)
    assert d.cache._pools[0].k.data.dtype == mx.bfloat16


def test_removed_sequence_starts_over_on_reuse_without_seeing_stale_rows():
    d = make_driver(KIND, [0, 3], max_write=3)
    a, b = d.cache.seq_new(), d.cache.seq_new()
    d.check([a] * 3 + [b] * 3, [0, 1, 2] * 2)
    d.check([a] * 3 + [b], [3, 4, 5, 3])
    d.cache.seq_rm(a)
    d.oracle.remove(a)
    assert d.cache.seq_new() == a
    d.check([a, b], [0, 4])  # row a still holds the old history past position 0
    d.check([a, b], [1, 5])


def test_fork_copies_the_prefix_then_diverges():
    d = make_driver(KIND, [0, 3], max_write=3)
    a = d.cache.seq_new()
    d.prefill(a, 0, 3)
    f = d.cache.seq_clone(a, 3)
    d.oracle.fork(a, f, 3)
    d.check([a, f], [3, 3])
    d.check([f, a], [4, 4])


def test_partial_flat_fork_copies_only_the_prefix():
    d = make_driver(KIND, [0], initial_capacity=2)
    a = d.cache.seq_new()
    d.prefill(a, 0, 8)
    f = d.cache.seq_clone(a, 3)
    d.oracle.fork(a, f, 3)
    d.cache.seq_rm(a)
    d.oracle.remove(a)
    d.check([f], [3])
    d.prefill(f, 4, 3)


def test_fork_and_source_diverge_on_different_tokens():
    d = make_driver(KIND, [0], initial_capacity=4)
    a = d.cache.seq_new()
    d.prefill(a, 0, 12)
    f = d.cache.seq_clone(a, 6)
    d.oracle.fork(a, f, 6)
    for _ in range(4):
        d.check([a, f], [d.cache.pos(a), d.cache.pos(f)])


def test_compacted_fork_grows_past_its_cloned_size():
    d = make_driver(KIND, [0], initial_capacity=2)
    a = d.cache.seq_new()
    d.prefill(a, 0, 40)
    f = d.cache.seq_clone(a, 6)
    d.oracle.fork(a, f, 6)
    d.cache.seq_rm(a)
    d.oracle.remove(a)
    d.prefill(f, 6, 24)
    d.check([f], [30])


def test_clone_of_a_mixed_model_is_bounded_by_its_ring_layer():
    d = make_driver(KIND, [0, 4], max_write=4)
    a = d.cache.seq_new()
    d.prefill(a, 0, 4)
    d.prefill(a, 4, 4)
    d.prefill(a, 8, 2)
    assert not d.cache.can_clone(a, 5)
    f = d.cache.seq_clone(a, 6)
    d.oracle.fork(a, f, 6)
    for _ in range(3):
        d.check([f, a], [d.cache.pos(f), d.cache.pos(a)])


def test_partial_fork_of_a_wrapped_ring():
    d = make_driver(KIND, [4], max_write=1)
    a = d.cache.seq_new()
    for pos in range(10):
        d.check([a], [pos])
    assert not d.cache.can_clone(a, 6)
    f = d.cache.seq_clone(a, 9)
    d.oracle.fork(a, f, 9)
    d.check([f, a], [9, 10])
    d.check([f, a], [10, 11])


def test_snapshot_survives_source_and_fork_writes():
    # 2 layers, flat + ring(4), max_write 3 (ring of 6), as mlx_sequence_clone_test.
    d = make_driver(KIND, [0, 4], capacity=256, max_write=3)
    src = d.cache.seq_new()
    for start in range(0, 21, 3):
        d.prefill(src, start, 3)
    snap = d.cache.seq_clone(src, 21)
    d.oracle.fork(src, snap, 21)
    for start in range(21, 27, 3):  # the source overwrites every ring slot
        d.prefill(src, start, 3)
    d.cache.seq_rm(src)
    d.oracle.remove(src)
    forks = []
    for upto in (21, 20, 18):
        f = d.cache.seq_clone(snap, upto)
        d.oracle.fork(snap, f, upto)
        forks.append(f)
    assert not d.cache.can_clone(snap, 17)
    d.check(forks, [21, 20, 18])
    d.check(forks + [snap], [22, 21, 19, 21])


def test_registry_builds_the_batched_sequence_layout():
    d = make_driver(KIND, [0])
    assert isinstance(d.cache, MLXBatchedSequenceCache)
    assert isinstance(d.cache, CacheControl)
    assert KIND in CACHE_FACTORY.kinds("mlx")


def test_removing_every_sequence_hands_memory_back():
    d = make_driver(KIND, [0])
    a = d.cache.seq_new()
    d.prefill(a, 0, 3)
    d.cache.seq_rm(a)
    assert d.cache._pools[0].k.data is None


def test_a_new_sequence_allocates_exactly_when_its_first_write_grows_the_pools():
    d = make_driver(KIND, [0, 2], max_write=3)
    grew = []
    for _ in range(6):
        predicted = d.cache.new_seq_allocates()
        before = [(p.k.rows, p.v.rows) for p in d.cache._pools]
        s = d.cache.seq_new()
        d.check([s], [0])
        after = [(p.k.rows, p.v.rows) for p in d.cache._pools]
        assert predicted == (after != before)
        grew.append(predicted)
    assert grew == [True, True, True, False, True, False]  # rows double: 1, 2, 4, 4, 8, 8
