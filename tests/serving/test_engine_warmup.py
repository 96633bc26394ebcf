"""Warming the engine up traces every bucket its steps can take: afterwards a workload of
mixed arrivals compiles nothing, and its greedy outputs still equal single-sequence runs."""
from __future__ import annotations

import pytest

from mlx_pte.serving.engine import Engine, EngineError, Request

from tests.serving.test_engine import PROMPTS

KINDS = ("batched-sequence", "batched-cell")


@pytest.mark.parametrize("kind", KINDS)
def test_after_warm_up_a_mixed_workload_compiles_nothing(program, oracle, kind):
    engine = Engine(program, kind, capacity=400, max_batch_tokens=24)
    assert engine.warm_up() >= 0
    assert engine.cache.live_seqs() == ()  # the scratch sequences are gone
    traced = program.compilations
    handles = [engine.submit(Request(p, max_tokens=10, ignore_eos=True)) for p in PROMPTS[:2]]
    for _ in range(3):
        engine.step()
    handles += [engine.submit(Request(p, max_tokens=10, n=2, ignore_eos=True)) for p in PROMPTS[2:]]
    engine.run()
    assert program.compilations == traced
    for prompt, handle in zip(PROMPTS, handles):
        expected = oracle(prompt, 10).tokens
        assert [s.tokens for s in handle.result(timeout=0).samples] == [expected] * handle.request.n


def test_warm_up_refuses_an_engine_holding_requests(program):
    engine = Engine(program, "batched-sequence", capacity=200, max_batch_tokens=16)
    engine.submit(Request([1, 2, 3], max_tokens=2))
    with pytest.raises(EngineError, match="before submitting"):
        engine.warm_up()
