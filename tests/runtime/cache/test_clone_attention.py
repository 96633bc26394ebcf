"""Forks and rewinds of wrapped rings, checked by attention against a cacheless oracle.

The shadow store counts stale reads (a ring slot read for a position it no longer holds);
every accepted fork must read none and match the oracle to 1e-12, and every prefix the
ring can no longer serve must be refused. Parameterised over max_write, so the ring has
``4 + max_write - 1`` slots.
"""
from __future__ import annotations

import numpy as np
import pytest

from mlx_pte.runtime.cache import CacheRefused, RingLayout

from .toy import WINDOW, forward, oracle, toy_cache

TOKENS = [int(t) for t in np.random.default_rng(1).integers(0, 64, size=48)]


def changed(tokens: list[int], at: int) -> list[int]:
    out = list(tokens)
    out[at] = (out[at] + 7) % 64
    return out


def expect_cold_equivalent(cache, src: int, tokens: list[int], upto: int, chunk: int) -> None:
    """A fork of ``src`` at ``upto``, fed the rest of ``tokens``, matches the oracle."""
    stale = cache.stale_reads
    fork = cache.seq_clone(src, upto)
    assert cache.pos(fork) == upto
    got = forward(cache, fork, tokens[upto:], upto, chunk)
    np.testing.assert_allclose(got, oracle(tokens)[upto:], rtol=0, atol=1e-12)
    assert cache.stale_reads == stale
    cache.seq_rm(fork)


@pytest.mark.parametrize("m", [1, 3, 5])
def test_a_wrapped_snapshot_survives_source_and_branch_writes(m):
    cache = toy_cache(m)
    source = cache.seq_new()
    np.testing.assert_allclose(forward(cache, source, TOKENS[:21], 0, m), oracle(TOKENS[:21]),
                               rtol=0, atol=1e-12)
    snap = cache.seq_clone(source, 21)
    forward(cache, source, TOKENS[21:40], 21, m)
    cache.seq_rm(source)

    expect_cold_equivalent(cache, snap, TOKENS[:24], 21, m)
    expect_cold_equivalent(cache, snap, changed(TOKENS[:24], 21 - m), 21 - m, m)
    expect_cold_equivalent(cache, snap, TOKENS[:24], 20, m)
    if m == 1:
        with pytest.raises(CacheRefused, match="from 20 on"):
            cache.seq_clone(snap, 19)
    else:
        expect_cold_equivalent(cache, snap, TOKENS[:24], 19, m)
    expect_cold_equivalent(cache, snap, TOKENS[:24], 21, m)
    assert cache.stale_reads == 0


@pytest.mark.parametrize("m", [1, 3, 5])
def test_an_older_snapshot_keeps_an_earlier_branch_window(m):
    cache = toy_cache(m)
    source = cache.seq_new()
    forward(cache, source, TOKENS[:9], 0, m)
    older = cache.seq_clone(source, 9)
    forward(cache, source, TOKENS[9:21], 9, m)
    newer = cache.seq_clone(source, 21)
    with pytest.raises(CacheRefused):
        cache.seq_clone(newer, 8)
    expect_cold_equivalent(cache, older, changed(TOKENS[:12], 8), 8, m)
    assert cache.stale_reads == 0


@pytest.mark.parametrize("m", [1, 3, 5])
def test_a_matching_window_does_not_stand_in_for_earlier_history(m):
    # The cache knows positions, not tokens: a fork reuses its prefix whatever the caller
    # now claims that prefix was, so the caller must compare whole token prefixes.
    cache = toy_cache(m)
    source = cache.seq_new()
    forward(cache, source, TOKENS[:21], 0, m)
    fork = cache.seq_clone(source, 20)
    claimed = changed(TOKENS[:24], 0)
    got = forward(cache, fork, claimed[20:], 20, m)
    assert cache.stale_reads == 0
    np.testing.assert_allclose(got, oracle(TOKENS[:20] + claimed[20:])[20:], rtol=0, atol=1e-12)
    assert not np.allclose(got, oracle(claimed)[20:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("m", [1, 3, 5])
def test_a_rewind_whose_rows_were_overwritten_is_refused(m):
    cache = toy_cache(m)
    source = cache.seq_new()
    forward(cache, source, TOKENS[:21], 0, m)
    too_far = 21 - m - 1
    with pytest.raises(CacheRefused):
        cache.rewind(source, too_far)
    with pytest.raises(CacheRefused):
        cache.seq_clone(source, too_far)
    assert cache.pos(source) == 21 and cache.live_seqs() == (source,)
    expect_cold_equivalent(cache, source, TOKENS[:24], 21 - m, m)

    # The hazard is real: replaying the ring's read plan from too_far without the
    # bookkeeping reads slots that later positions overwrote.
    layout = RingLayout(WINDOW, m)
    cache.read_plan(source, 1, layout.plan(21 - m, 1))
    assert cache.stale_reads == 0
    entries = cache.read_plan(source, 1, layout.plan(too_far, 1))
    assert cache.stale_reads > 0
    read_base = layout.plan(too_far, 1).read_base
    assert [e[0] for e in entries] != list(range(read_base, too_far + 1))
