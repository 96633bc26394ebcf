"""Random scenarios on every kind against the oracle: steps of several sequences,
prefill chunks, decode, forks, removals and rewinds on a flat + ring model."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_pte.runtime.mlx import padded

from .helpers import make_driver

WINDOWS = [0, 3, 5]
MAX_WRITE = 3


def run_scenario(kind: str, seed: int, steps: int = 10) -> None:
    rnd = random.Random(seed)
    d = make_driver(kind, WINDOWS, capacity=400, max_write=MAX_WRITE, initial_capacity=2,
                    seed=seed, softcap=rnd.choice([0.0, 0.0, 3.0]))
    cache, oracle = d.cache, d.oracle
    live = [cache.seq_new()]
    more = cache.max_seqs() is None  # single: its one sequence only
    for _ in range(steps):
        op = rnd.random()
        if more and op < 0.15:
            live.append(cache.seq_new())
        elif more and op < 0.25 and any(cache.pos(s) for s in live):
            src = rnd.choice([s for s in live if cache.pos(s)])
            upto = rnd.randint(1, cache.pos(src))
            if cache.can_clone(src, upto):
                dst = cache.seq_clone(src, upto)
                oracle.fork(src, dst, upto)
                live.append(dst)
        elif more and op < 0.32 and len(live) > 1:
            gone = live.pop(rnd.randrange(len(live)))
            cache.seq_rm(gone)
            oracle.remove(gone)
        elif op < 0.4:
            seq = rnd.choice(live)
            target = rnd.randint(0, cache.pos(seq))
            if cache.can_rewind(seq, target):
                cache.rewind(seq, target)
                oracle.rewind(seq, target)
        # A step: a random subset of live sequences, each with 1..MAX_WRITE tokens.
        chosen = rnd.sample(live, rnd.randint(1, len(live)))
        seq_ids, positions = [], []
        for seq in chosen:
            start = cache.pos(seq)
            n = rnd.choice([1, 1, 2, MAX_WRITE])
            seq_ids += [seq] * n
            positions += range(start, start + n)
        d.check(seq_ids, positions, atol=5e-5)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31))
@pytest.mark.parametrize("kind", ["single", "batched-cell"])
def test_random_scenarios(kind, seed):
    run_scenario(kind, seed)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31))
@pytest.mark.parametrize("overhead", [None, 10**9, -(10**9)], ids=["auto", "padded", "spans"])
def test_random_batched_sequence_scenarios(overhead, seed):
    with pytest.MonkeyPatch.context() as mp:
        if overhead is not None:
            mp.setattr(padded, "SPAN_OVERHEAD_PAIRS", overhead)
        run_scenario("batched-sequence", seed)
